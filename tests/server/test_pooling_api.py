"""Serving pooling models end to end, against live uvicorn servers on tiny random encoder
checkpoints (an embedding BertModel with MEAN pooling, a 3-label BertForSequenceClassification, a
1-label XLM-R reranker): `/v1/embeddings` with the official `openai` client (float, base64,
dimensions) and vLLM's `/pooling`, `/classify`, `/score` and `/rerank` with httpx give what
`LLM.embed / encode / classify / score` give on the same folder; rerank sorts and cuts to top_n;
the wrong kind of model for an endpoint, unsupported tasks and bad input are 400s naming the field;
`jaxengine serve --runner pooling` builds the pooling engine."""

from __future__ import annotations

import base64
import contextlib

import httpx
import numpy as np
import openai
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

from jaxengine import LLM
from jaxengine.async_engine import AsyncEngine
from jaxengine.async_pooling import AsyncPoolingEngine
from jaxengine.pooling_params import PoolingParams
from jaxengine.server.api_server import build_app
from tests.engine.test_pooling import TEXTS, _make
from tests.server.conftest import LiveServer
from tests.server.fake_engine import FakeEngine

KEY = "sk-pool"
QUERY, DOCS = "where did the dog go", ["the sun is hot", "a dog ran in the park", "the cat sat on the mat", "sky"]
LONG = " ".join(["cat"] * 100)  # over the tiny models' 64 positions
CLOSE = dict(rtol=1e-5, atol=1e-6)  # batches of other sizes run other (bucketed) programs: float32 rounding


@pytest.fixture(scope="module")
def served(tmp_path_factory, xla_cache_dir):
    """name -> (reference LLM, live server); each model is written, loaded and served once."""
    made: dict[str, tuple[LLM, LiveServer]] = {}
    with contextlib.ExitStack() as stack:
        def get(name: str) -> tuple[LLM, LiveServer]:
            if name not in made:
                folder = str(tmp_path_factory.mktemp(name))
                if name == "embed":
                    _make(folder, transformers.BertModel, transformers.BertConfig, pooling="MEAN")
                elif name == "classify":
                    _make(folder, transformers.BertForSequenceClassification, transformers.BertConfig, num_labels=3)
                else:
                    _make(folder, transformers.XLMRobertaForSequenceClassification, transformers.XLMRobertaConfig,
                          num_labels=1, pad_token_id=0, type_vocab_size=1)
                kw = dict(runner="pooling", max_num_seqs=4, compilation_cache_dir=xla_cache_dir)
                reference, serving = LLM(folder, **kw), LLM(folder, **kw)  # two engines: nothing shared
                app = build_app(AsyncPoolingEngine(serving.pooling_engine), served_model_names=[name],
                                model_path=folder, api_key=KEY if name == "embed" else None)
                made[name] = (reference, stack.enter_context(LiveServer(app)))
            return made[name]
        yield get


@pytest.fixture(scope="module")
def generative():
    """A generative server (the model-free fake engine) for the cross-errors."""
    app = build_app(AsyncEngine(FakeEngine()), served_model_names=["gen"])
    with LiveServer(app) as srv:
        yield srv


def post(srv: LiveServer, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def error(r: httpx.Response, status: int, param: str | None, *texts: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for text in texts:
        assert text in err["message"], err["message"]
    return err


def ids_of(llm: LLM, text: str) -> list[int]:
    return list(llm.get_tokenizer()(text)["input_ids"])


# -- embeddings ------------------------------------------------------------------------------------
def test_embeddings_with_the_openai_client_equal_llm_embed(served):
    llm, srv = served("embed")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    want = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])

    as_float = client.embeddings.create(model="embed", input=TEXTS, encoding_format="float")
    assert [d.index for d in as_float.data] == [0, 1, 2, 3] and as_float.model == "embed"
    np.testing.assert_allclose([d.embedding for d in as_float.data], want, **CLOSE)
    n_tokens = sum(len(ids_of(llm, t)) for t in TEXTS)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == n_tokens
    # no encoding_format: the client asks for base64 and decodes it to floats itself
    decoded = client.embeddings.create(model="embed", input=TEXTS)
    np.testing.assert_allclose([d.embedding for d in decoded.data], want, **CLOSE)
    # asked explicitly, base64 comes back as sent: little-endian float32 bytes
    raw = client.embeddings.create(model="embed", input=TEXTS[0], encoding_format="base64").data[0].embedding
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(raw), "<f4"), want[0], **CLOSE)

    short = client.embeddings.create(model="embed", input=TEXTS[:2], dimensions=8, encoding_format="float")
    ref = llm.embed(TEXTS[:2], PoolingParams(dimensions=8), use_tqdm=False)
    np.testing.assert_allclose([d.embedding for d in short.data], [o.outputs.embedding for o in ref], **CLOSE)
    assert len(short.data[0].embedding) == 8
    # token ids in, and vLLM's extras: normalize, truncate_prompt_tokens
    ids = ids_of(llm, TEXTS[1])
    by_ids = client.embeddings.create(model="embed", input=[ids, ids[:3]], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, want[1], **CLOSE)
    body = {"model": "embed", "input": LONG, "truncate_prompt_tokens": 10, "normalize": False}
    r = post(srv, "/v1/embeddings", body)
    ref = llm.embed(LONG, PoolingParams(normalize=False), truncate_prompt_tokens=10, use_tqdm=False)[0]
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], ref.outputs.embedding, **CLOSE)
    assert r.json()["usage"]["prompt_tokens"] == 10 and r.json()["object"] == "list"


def test_concurrent_requests_are_served_one_by_one_and_all_correct(served):
    import asyncio

    llm, srv = served("embed")
    want = [llm.embed(t, use_tqdm=False)[0].outputs.embedding for t in TEXTS]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=60) as c:
            embeds = [c.post("/v1/embeddings", json={"input": TEXTS[i % 4], "encoding_format": "float"})
                      for i in range(12)]
            return await asyncio.gather(*embeds, c.get("/health"))

    *outs, health = asyncio.run(run())
    assert health.status_code == 200
    for i, r in enumerate(outs):
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], want[i % 4], **CLOSE)
    assert srv.app.state.engine.num_open_requests == 0


def test_pooling_endpoint_equals_llm_encode(served):
    for name in ("embed", "classify"):  # the pooled vector; a classifier's logits
        llm, srv = served(name)
        r = post(srv, "/pooling", {"model": name, "input": TEXTS[:3]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling"] * 3
        want = [o.outputs.data for o in llm.encode(TEXTS[:3], use_tqdm=False)]
        np.testing.assert_allclose([d["data"] for d in body["data"]], want, **CLOSE)
        b64 = post(srv, "/pooling", {"model": name, "input": TEXTS[0], "encoding_format": "base64"}).json()
        one = llm.encode(TEXTS[0], use_tqdm=False)[0].outputs.data  # the same batch shape as the request's
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(b64["data"][0]["data"]), "<f4"), one,
                                   **CLOSE)


# -- classify, score, rerank --------------------------------------------------------------------------
def test_classify_equals_llm_classify(served):
    llm, srv = served("classify")
    r = post(srv, "/classify", {"model": "classify", "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("classify-") and body["object"] == "list" and body["model"] == "classify"
    want = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
    np.testing.assert_allclose([d["probs"] for d in body["data"]], want, **CLOSE)
    labels = llm.pooling_engine.model_config.id2label
    assert [d["label"] for d in body["data"]] == [labels[int(np.argmax(p))] for p in want]
    assert {d["num_classes"] for d in body["data"]} == {3} and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == sum(len(ids_of(llm, t)) for t in TEXTS)


def test_score_equals_llm_score(served):
    for name in ("reranker", "embed"):  # a cross-encoder; an embedding model's cosine similarity
        llm, srv = served(name)
        for path, t1, t2 in (("/score", QUERY, DOCS), ("/v1/score", [QUERY, "what is hot"], DOCS[:2])):
            r = post(srv, path, {"model": name, "text_1": t1, "text_2": t2})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["id"].startswith("score-") and {d["object"] for d in body["data"]} == {"score"}
            want = [o.outputs.score for o in llm.score(t1, t2, use_tqdm=False)]
            np.testing.assert_allclose([d["score"] for d in body["data"]], want, **CLOSE)


def test_rerank_sorts_cuts_and_equals_llm_score(served):
    llm, srv = served("reranker")
    scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    order = list(np.argsort(-np.asarray(scores), kind="stable"))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = post(srv, path, {"model": "reranker", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("rerank-") and body["model"] == "reranker" and body["usage"]["total_tokens"] > 0
        assert [x["index"] for x in body["results"]] == order
        assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in order]
        np.testing.assert_allclose([x["relevance_score"] for x in body["results"]], [scores[i] for i in order],
                                   **CLOSE)
    top = post(srv, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == order[:2] and "document" not in top["results"][0]
    # an embedding model reranks by cosine similarity, as LLM.score does
    emb, emb_srv = served("embed")
    cos = [o.outputs.score for o in emb.score(QUERY, DOCS, use_tqdm=False)]
    got = post(emb_srv, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1}).json()["results"]
    assert len(got) == 1 and got[0]["index"] == int(np.argmax(cos))


# -- errors -------------------------------------------------------------------------------------------
def test_a_generative_model_refuses_pooling_endpoints(generative):
    bodies = {"/v1/embeddings": {"input": "hi"}, "/pooling": {"input": "hi"}, "/classify": {"input": "hi"},
              "/score": {"text_1": "a", "text_2": "b"}, "/v1/rerank": {"query": "a", "documents": ["b"]}}
    for path, body in bodies.items():
        error(post(generative, path, {"model": "gen", **body}), 400, "model", "is a generative model",
              "--runner pooling", path)
    error(post(generative, "/v1/embeddings", {"model": "nope", "input": "hi"}), 404, "model", "does not exist")


def test_a_pooling_model_refuses_generation_and_unsupported_tasks(served):
    _, srv = served("embed")
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        error(post(srv, path, {"model": "embed", **body}), 400, "model", "is a pooling model", "/v1/embeddings")
    error(post(srv, "/v1/completions", {"model": "nope", "prompt": "hi"}), 404, "model")
    error(post(srv, "/classify", {"model": "embed", "input": "hi"}), 400, "model", "does not support /classify")
    _, reranker = served("reranker")
    error(post(reranker, "/v1/embeddings", {"input": "hi"}), 400, "model", "does not support /v1/embeddings")


@pytest.mark.parametrize("path, body, param, text", [
    ("/v1/embeddings", {"input": []}, "input", "empty"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input", "empty"),
    ("/v1/embeddings", {"input": LONG}, "input", "max_model_len"),
    ("/v1/embeddings", {"input": [[2, 10**6]]}, "input", "out of vocabulary"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 64}, "dimensions", "dimensions=64 exceeds"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions", "dimensions"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "binary"}, "encoding_format", "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate"),
    ("/v1/embeddings", {"input": "hi", "colour": 1}, "colour", "Unrecognized"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2", "text_1 has 2 texts"),
    ("/score", {"text_1": [], "text_2": "a"}, "text_1", "empty"),
    ("/rerank", {"query": "a", "documents": []}, "documents", "empty"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", "top_n"),
])
def test_bad_input_names_the_field(served, path, body, param, text):
    _, srv = served("embed")
    error(post(srv, path, body), 400, param, text)


def test_models_health_auth_and_metrics(served):
    llm, srv = served("embed")
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.post(srv.url + "/v1/embeddings", json={"input": "hi"}).status_code == 401
    models = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == ["embed"] and models["data"][0]["max_model_len"] == 64
    tokens = post(srv, "/tokenize", {"prompt": TEXTS[0]}).json()["tokens"]
    assert tokens == ids_of(llm, TEXTS[0])
    before = _samples(srv)
    post(srv, "/v1/embeddings", {"input": TEXTS[:2]})
    after = _samples(srv)
    assert after["jaxengine:request_success_total"] - before.get("jaxengine:request_success_total", 0) == 2
    assert after["jaxengine:prompt_tokens_total"] - before.get("jaxengine:prompt_tokens_total", 0) == \
        sum(len(ids_of(llm, t)) for t in TEXTS[:2])


def _samples(srv: LiveServer) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_serve_builds_the_pooling_engine(served, monkeypatch, xla_cache_dir):
    from jaxengine.cli import build_parser
    from jaxengine.pooling import PoolingEngine
    from jaxengine.server import cli

    llm, _ = served("embed")
    folder = llm.pooling_engine.config.model
    got = []
    monkeypatch.setattr(cli, "run_server", lambda engine, settings, **_: got.append(engine) or 0)
    for flags in (["--runner", "pooling"], ["--task", "embed"], []):  # an encoder folder is recognised alone
        args = build_parser().parse_args(["serve", folder, "--compilation-cache-dir", xla_cache_dir, *flags])
        assert cli.cmd_serve(args) == 0
        assert isinstance(got[-1], PoolingEngine)


def test_decoder_embeddings_over_http(tiny_model_factory, xla_cache_dir):
    """A decoder with --runner pooling: /v1/embeddings (the openai client) equals LLM.embed's
    last-token embeddings, and completions are refused with the pooling endpoints named."""
    path = tiny_model_factory("llama")
    kw = dict(runner="pooling", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=32,
              compilation_cache_dir=xla_cache_dir)
    reference, serving = LLM(path, **kw), LLM(path, **kw)
    texts = ["Hello, my name is", "The capital of France is"]
    want = [o.outputs.embedding for o in reference.embed(texts, use_tqdm=False)]
    app = build_app(AsyncPoolingEngine(serving.pooling_engine), served_model_names=["dec"], model_path=path)
    with LiveServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.embeddings.create(model="dec", input=texts, encoding_format="float")
        np.testing.assert_allclose([d.embedding for d in got.data], want, **CLOSE)
        r = post(srv, "/v1/completions", {"model": "dec", "prompt": "hi"}, key=None)
        assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
