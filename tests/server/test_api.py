"""The server end to end with the official `openai` client, against a live uvicorn on a tiny random
Llama: what it returns equals `LLM.generate` / `LLM.chat` for the same parameters (greedy and
seeded) and `LLM.beam_search` (`use_beam_search`), streams are well-formed OpenAI SSE, 32 concurrent
streams complete correctly, disconnects abort, no KV block leaks, and /metrics moves as requests
complete."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxengine import LLM, BeamSearchParams, SamplingParams
from jaxengine.server.api_server import build_app
from jaxengine.async_engine import AsyncEngine
from tests.server.conftest import ENGINE_KW, LiveServer, make_engine

MODEL = "tiny-llama"
PROMPTS = ["Hello, my name is", "The capital of France is", "def add(a, b):\n    return",
           "1 2 3 4 5 6 7 8"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(tiny_llama, xla_cache_dir):
    engine = make_engine(tiny_llama, xla_cache_dir)
    app = build_app(AsyncEngine(engine), served_model_names=[MODEL, "alias"], model_path=tiny_llama)
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_llama, xla_cache_dir) -> LLM:
    return LLM(tiny_llama, compilation_cache_dir=xla_cache_dir, **ENGINE_KW)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_call(server: LiveServer, fn):  # noqa: ANN001, ANN201
    return server.app.state.engine.call_threadsafe(fn, timeout=30)


def kv_pool_is_full(server: LiveServer) -> bool:
    def check(e) -> bool:  # noqa: ANN001
        return (not e.has_unfinished_requests()
                and e.scheduler.block_manager.num_free_blocks == e.config.num_kv_blocks - 1)
    return engine_call(server, check)


def wait_idle(server: LiveServer, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine_call(server, lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def metric_samples(server: LiveServer) -> dict[tuple[str, str | None], float]:
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, s.labels.get("finished_reason"))] = s.value
    return out


# -- plain endpoints ------------------------------------------------------------------------------
def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    assert client.models.retrieve("alias").id == "alias"
    assert httpx.get(server.url + "/health").status_code == 200
    import jaxengine
    assert httpx.get(server.url + "/version").json() == {"version": jaxengine.__version__}


def test_tokenize_and_detokenize(server, reference):
    tok = reference.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == ENGINE_KW["max_model_len"] and len(r["token_strs"]) == r["count"]
    chat = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    from jaxengine.llm import render_chat
    assert chat["tokens"] == render_chat(tok, CHAT, None, True)[1] and chat["token_strs"] is None
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}


def test_chat_template_kwargs_reach_the_template(server, client):
    """vLLM's chat_template_kwargs are template variables: an unknown one is simply available to
    the template; one that is an argument of its own is a 400 naming the field."""
    r = httpx.post(server.url + "/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    bad = httpx.post(server.url + "/tokenize", json={"messages": CHAT,
                                                      "chat_template_kwargs": {"add_generation_prompt": False}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].finish_reason == "length"


def test_unserved_routes_answer_in_openai_error_json(server, client):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "route_not_found" and "POST /v1/responses is not served" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model=MODEL, file=("a.wav", b"RIFF"))
    # a pooling route on a generative model: served, and refused with what to do instead
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model=MODEL, input="hi")


# -- completions ------------------------------------------------------------------------------------
def test_completions_greedy_equal_llm_generate(client, reference):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0)
    ref = reference.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == MODEL
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref]
    assert [c.finish_reason for c in resp.choices] == [r.outputs[0].finish_reason for r in ref]
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert resp.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in ref)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    # the same through a stream, and from token ids
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref[0].outputs[0].text
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == ref[0].outputs[0].finish_reason
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    ids = [r.prompt_token_ids for r in ref[:2]]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert [c.text for c in by_ids.choices] == [r.outputs[0].text for r in ref[:2]]
    single = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=16, temperature=0, echo=True)
    assert single.choices[0].text == reference.get_tokenizer().decode(ids[0]) + ref[0].outputs[0].text


def test_logit_edits_and_prompt_truncation(client, reference):
    """logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens reach the sampler and
    the prompt as they do through `LLM.generate`."""
    edits = [dict(logit_bias={"7": 100}), dict(allowed_token_ids=[5, 9, 11]), dict(bad_words=["the", "and"])]
    for kw in edits:
        params = {k: ({int(t): v for t, v in val.items()} if k == "logit_bias" else val) for k, val in kw.items()}
        want = reference.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0, **params), use_tqdm=False)
        extra = {k: v for k, v in kw.items() if k != "logit_bias"}
        resp = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, temperature=0,
                                         logit_bias=kw.get("logit_bias"), extra_body=extra or None)
        assert [c.text for c in resp.choices] == [r.outputs[0].text for r in want], kw
    assert set(want[0].outputs[0].token_ids) & set(reference.get_tokenizer().encode(" the", add_special_tokens=False)) == set()
    blue = reference.get_tokenizer().encode(" blue", add_special_tokens=False)[0]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                          logit_bias={str(blue): 100})
    assert chat.choices[0].message.content == reference.get_tokenizer().decode([blue] * 4)
    long = " ".join(["word"] * 400)  # above max_model_len: refused unless truncated
    resp = client.completions.create(model=MODEL, prompt=long, max_tokens=4, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 20})
    assert resp.usage.prompt_tokens == 20


def test_completions_seeded_n_equal_llm_generate(client, reference):
    kw = dict(n=3, temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    ref = reference.generate(PROMPTS[1], SamplingParams(**kw), use_tqdm=False)[0]
    expected = [o.text for o in ref.outputs]
    assert len(set(expected)) > 1  # the three samples differ
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], **kw)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == expected
    streamed = ["", "", ""]
    finishes = {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[1], stream=True, **kw):
        for c in chunk.choices:
            assert c.index not in finishes, "text after the finish chunk"
            streamed[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert streamed == expected and set(finishes) == {0, 1, 2}
    # several prompts x n in one stream: choice index = prompt index * n + sequence index
    two = reference.generate(PROMPTS[:2], SamplingParams(n=2, temperature=0.8, seed=9, max_tokens=6), use_tqdm=False)
    texts = [""] * 4
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, temperature=0.8, seed=9,
                                           max_tokens=6, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [o.text for r in two for o in r.outputs]
    # extras (top_k, min_p, repetition_penalty, min_tokens) reach the sampler the same way
    extra = dict(top_k=20, min_p=0.05, repetition_penalty=1.2, min_tokens=4)
    ref2 = reference.generate(PROMPTS[2], SamplingParams(temperature=0.7, seed=5, max_tokens=10, **extra),
                              use_tqdm=False)[0]
    resp2 = client.completions.create(model=MODEL, prompt=PROMPTS[2], temperature=0.7, seed=5, max_tokens=10,
                                      extra_body=extra)
    assert resp2.choices[0].text == ref2.outputs[0].text


def test_completions_logprobs(client, reference):
    ref = reference.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for i, tid in enumerate(ref.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(ref.logprobs[i][tid].logprob, abs=1e-5)
        assert lp.tokens[i] == ref.logprobs[i][tid].decoded_token
        assert 3 <= len(lp.top_logprobs[i]) <= 4
        assert max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-6
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    streamed_tokens = []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           logprobs=3, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices[0].logprobs is not None:
            streamed_tokens += chunk.choices[0].logprobs.tokens
    assert streamed_tokens == lp.tokens


def test_completions_echo_with_logprobs_and_prompt_logprobs(client, reference):
    ref = reference.generate(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=2,
                                                        ignore_eos=True), use_tqdm=False)[0]
    n_prompt = len(ref.prompt_token_ids)
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    resp = client.completions.create(**kw)
    c = resp.choices[0]
    assert c.text == PROMPTS[1] + ref.outputs[0].text
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, n_prompt):
        tid = ref.prompt_token_ids[pos]
        assert lp.token_logprobs[pos] == pytest.approx(ref.prompt_logprobs[pos][tid].logprob, abs=1e-5)
    for i, tid in enumerate(ref.outputs[0].token_ids):
        assert lp.token_logprobs[n_prompt + i] == pytest.approx(ref.outputs[0].logprobs[i][tid].logprob, abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # streamed: the echo chunk (after the prompt is processed) carries the prompt's logprobs
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].text == PROMPTS[1]
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs[:n_prompt]
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    # vLLM's prompt_logprobs field, for completions and chat
    raw = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 1})
    plp = raw.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None
    tid = ref.prompt_token_ids[1]
    assert plp[1][str(tid)]["logprob"] == pytest.approx(ref.prompt_logprobs[1][tid].logprob, abs=1e-5)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_completions_stop_strings(client, reference):
    free = reference.generate(PROMPTS[3], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    stop = free[6:9]
    assert len(stop) == 3 and stop.strip()
    params = dict(max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    ref = reference.generate(PROMPTS[3], SamplingParams(ignore_eos=True, **params), use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop" and ref.text == free[:free.index(stop)]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[3], extra_body={"ignore_eos": True}, **params)
    c = resp.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (ref.text, "stop", stop)
    # streamed text never shows any part of the stop string, even transiently
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], stream=True,
                                            extra_body={"ignore_eos": True}, **params))
    assert "".join(ch.choices[0].text for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    inc = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert inc.choices[0].text == ref.text + stop


# -- chat -------------------------------------------------------------------------------------------
def test_chat_greedy_and_seeded_equal_llm_chat(client, reference):
    ref = reference.chat(CHAT, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    msg = resp.choices[0].message
    assert (msg.role, msg.content) == ("assistant", ref.outputs[0].text)
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    # content as text parts, and max_completion_tokens, render and generate the same
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    resp2 = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=12, temperature=0)
    assert resp2.choices[0].message.content == ref.outputs[0].text

    kw = dict(n=2, temperature=1.0, seed=77, max_tokens=10)
    ref_n = reference.chat(CHAT, SamplingParams(**kw), use_tqdm=False)[0]
    resp_n = client.chat.completions.create(model=MODEL, messages=CHAT, **kw)
    assert [c.message.content for c in resp_n.choices] == [o.text for o in ref_n.outputs]


def test_chat_stream_shape(client, reference):
    history = CHAT + [{"role": "assistant", "content": "Red."},
                      {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
                      {"role": "user", "content": "More?"}]
    kw = dict(n=2, temperature=1.0, seed=3, max_tokens=10)
    ref = reference.chat(history, SamplingParams(**kw), use_tqdm=False)[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=history, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len({c.id for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == sum(
        len(o.token_ids) for o in ref.outputs)
    assert all(c.usage is None for c in chunks[:-1])
    for index, expected in enumerate(o.text for o in ref.outputs):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert all(ch.delta.role is None for ch in mine[1:])
        assert all(ch.finish_reason is None for ch in mine[:-1])
        assert mine[-1].finish_reason == ref.outputs[index].finish_reason and mine[-1].delta.content is None
        assert "".join(ch.delta.content or "" for ch in mine) == expected


def test_chat_logprobs(client, reference):
    ref = reference.chat(CHAT, SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 6
    for entry, tid, lps in zip(content, ref.token_ids, ref.logprobs):
        assert entry.logprob == pytest.approx(lps[tid].logprob, abs=1e-5)
        assert entry.token == lps[tid].decoded_token and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the best
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True,
                                                extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += [e.token for e in chunk.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


# -- many clients, disconnects, leaks ------------------------------------------------------------------
def test_beam_search_equals_llm_beam_search(server, client, reference):
    """`use_beam_search` with n beams: n choices, best first, equal to `LLM.beam_search`'s sequences;
    several prompts in one request; the KV pool is whole again afterwards."""
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    ref = reference.beam_search(PROMPTS[:2], params)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6,
                                     extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [s.output_text for out in ref for s in out.sequences]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 4 * 6
    assert resp.usage.prompt_tokens == sum(s.num_prompt_tokens for out in ref for s in out.sequences[:1])

    tok = reference.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    [chat_ref] = reference.beam_search({"prompt_token_ids": ids}, BeamSearchParams(3, 5, length_penalty=0.5))
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_tokens=5,
                                          extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.message.content for c in chat.choices] == [s.output_text for s in chat_ref.sequences]
    assert [c.finish_reason for c in chat.choices] == [s.finish_reason for s in chat_ref.sequences]
    wait_idle(server)
    assert kv_pool_is_full(server)


def test_beam_search_refusals(client):
    """Streaming, sampling fields beam search does not use, and a bad width: 400 with OpenAI's error JSON."""
    cases = [(dict(stream=True), "stream"), (dict(top_p=0.5), "top_p"), (dict(logprobs=2), "logprobs"),
             (dict(n=11), "n"), (dict(extra_body={"use_beam_search": True, "length_penalty": "x"}), "length_penalty")]
    for kw, param in cases:
        body = {"extra_body": {"use_beam_search": True}, "n": 2, **kw}
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, **body)
        assert err.value.status_code == 400 and err.value.body["param"] == param, (kw, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=4, stream=True,
                                       extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "stream" and "cannot be streamed" in err.value.body["message"]


def test_32_concurrent_streams_complete_and_leak_nothing(server, reference):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    lengths = [8 + (i * 5) % 17 for i in range(32)]
    ref = reference.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                       for n in lengths], use_tqdm=False)

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        text, finish, chunks = "", None, 0
        stream = await aclient.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i],
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            chunks += 1
            assert finish is None, "chunk after the finish chunk"
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason
        return text, finish, chunks

    async def main():  # noqa: ANN202
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))

    results = asyncio.run(main())
    for (text, finish, _), r in zip(results, ref):
        assert (text, finish) == (r.outputs[0].text, "length")
    # Outputs not yet sent are merged (the newest cumulative output wins), so a short request
    # that runs while the event loop is busy accepting the other 31 may arrive in one chunk;
    # the streams as a whole must still arrive piecemeal.
    chunks = [c for _, _, c in results]
    assert sum(c > 1 for c in chunks) >= len(chunks) // 2, chunks
    assert kv_pool_is_full(server)
    assert server.app.state.engine.num_open_requests == 0


def test_disconnects_abort_and_leak_nothing(server):
    before = metric_samples(server)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, payload in (("/v1/completions", body),
                              ("/v1/chat/completions", {**{k: v for k, v in body.items() if k != "prompt"},
                                                        "messages": CHAT})):
            for _ in range(2):
                with http.stream("POST", path, json={**payload, "stream": True}) as r:
                    assert r.status_code == 200
                    seen = 0
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            json.loads(line[6:])
                            seen += 1
                            if seen == 3:
                                break  # hang up mid-stream
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client giving up (240 tokens take ~0.3 s here)
        httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 240}, timeout=0.05)
    wait_idle(server)
    assert kv_pool_is_full(server)
    after = metric_samples(server)
    aborted = after[("jaxengine:request_success_total", "abort")] - before[("jaxengine:request_success_total", "abort")]
    assert aborted == 5


# -- metrics ------------------------------------------------------------------------------------------
def test_metrics_move_as_requests_complete(server, client, reference):
    before = metric_samples(server)
    names = {name for name, _ in before}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count",
                 "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_success_total"):
        assert "jaxengine:" + name in names, name
    prompt = " / ".join(PROMPTS) + " metrics"  # more than one 16-token block: the second request hits the cache
    n_prompt = len(reference.get_tokenizer().encode(prompt))
    assert n_prompt > 16
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metric_samples(server)

    def delta(name: str, reason: str | None = None) -> float:
        return after[("jaxengine:" + name, reason)] - before[("jaxengine:" + name, reason)]

    assert delta("prompt_tokens_total") == 2 * n_prompt
    assert delta("generation_tokens_total") == 10
    assert delta("request_success_total", "length") == 2
    assert delta("time_to_first_token_seconds_count") == 2
    assert delta("e2e_request_latency_seconds_count") == 2
    assert delta("time_per_output_token_seconds_count") == 2
    assert delta("prefix_cache_queries_total") >= n_prompt
    assert delta("prefix_cache_hits_total") > 0  # the second request reuses the first one's prompt blocks
    assert after[("jaxengine:num_requests_running", None)] == 0
    assert after[("jaxengine:kv_cache_usage_perc", None)] == 0


def test_step_and_phase_histograms(server, client):
    """Iteration tokens are exactly what the scheduler scheduled; every finished request has its
    queue, prefill, decode and inference time; and an inter-token interval per streamed step."""
    from jaxengine.server.metrics import WithVllmNames

    def scheduled(e) -> tuple[int, int]:  # noqa: ANN001
        return e.core.scheduled_steps, e.core.scheduled_tokens

    wait_idle(server)
    before, (steps0, tokens0) = metric_samples(server), engine_call(server, scheduled)
    n_req, max_tokens = 3, 6
    for i in range(n_req):
        client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    wait_idle(server)
    after, (steps1, tokens1) = metric_samples(server), engine_call(server, scheduled)

    def delta(name: str) -> float:
        return after[("jaxengine:" + name, None)] - before[("jaxengine:" + name, None)]

    assert steps1 - steps0 >= n_req * (max_tokens - 1)
    assert delta("iteration_tokens_total_count") == steps1 - steps0
    assert delta("iteration_tokens_total_sum") == tokens1 - tokens0
    assert delta("inter_token_latency_seconds_count") == n_req * (max_tokens - 1)  # one token per step each
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"request_{phase}_time_seconds_count") == n_req, phase
        assert delta(f"request_{phase}_time_seconds_sum") >= 0, phase
    assert delta("request_inference_time_seconds_sum") == pytest.approx(
        delta("request_prefill_time_seconds_sum") + delta("request_decode_time_seconds_sum"), abs=1e-6)
    # queue + inference (arrival to last token) never exceeds end to end (arrival to finish).
    assert delta("request_queue_time_seconds_sum") + delta("request_inference_time_seconds_sum") <= \
        delta("e2e_request_latency_seconds_sum") + 1e-6
    assert not [name for name, _ in after if name.startswith("vllm:")]  # only with --metrics-vllm-names
    # The vLLM names, over this engine's own numbers: the same samples.
    metrics = server.app.state.metrics
    aliased = {}
    for fam in text_string_to_metric_families(generate_latest(WithVllmNames(metrics.registry)).decode()):
        for s in fam.samples:
            aliased[(s.name, s.labels.get("finished_reason"))] = s.value
    for name in ("iteration_tokens_total_sum", "request_queue_time_seconds_count", "request_decode_time_seconds_sum",
                 "prompt_tokens_total", "num_requests_running", "kv_cache_usage_perc"):
        assert aliased["vllm:" + name, None] == aliased["jaxengine:" + name, None] == after["jaxengine:" + name, None]
    assert aliased["vllm:time_per_output_token_seconds_count", None] == \
        aliased["jaxengine:inter_token_latency_seconds_count", None]
