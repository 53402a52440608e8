"""LoRA adapters over HTTP with the official `openai` client, on a tiny random Llama with two
hand-written PEFT adapters loaded at start-up as `--lora-modules` does (`load_lora_modules`):
an adapter's name as `model` gives the greedy text of transformers with that adapter merged
(completions, streamed or not), chat runs with it, the base model is unaffected, `/v1/models`
lists adapters with their parent, and the runtime load/unload routes work (only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING) with vLLM's success texts and 400/404/409 errors."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import transformers

from jaxengine.async_engine import AsyncEngine
from jaxengine.lora import LoRAConfig, LoRAManager, LoRARequest
from jaxengine.server.api_server import build_app
from jaxengine.server.serving_lora import LoRAModulePath, load_lora_modules
from tests.engine.test_lora import ALL, merged_greedy, write_adapter
from tests.server.conftest import LiveServer, make_engine
from tests.server.fake_engine import FakeEngine
from tests.tiny_checkpoints import load_reference

BASE = "tiny-llama"
PROMPT = "The capital of France is"
N = 8
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def setup(tiny_llama, xla_cache_dir, tmp_path_factory):
    ref = load_reference(tiny_llama)
    root = tmp_path_factory.mktemp("lora_api")
    deltas = {"sql": write_adapter(str(root / "sql"), ref, 4, 8.0, ("q_proj", "v_proj", "o_proj"), 11),
              "chat": write_adapter(str(root / "chat"), ref, 8, 16.0, ALL, 12)}
    write_adapter(str(root / "late"), ref, 2, 4.0, ("gate_proj", "down_proj"), 13)  # loaded at runtime
    write_adapter(str(root / "wide"), ref, 16, 16.0, ("q_proj",), 14)  # rank above max_lora_rank
    engine = make_engine(tiny_llama, xla_cache_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    modules = [LoRAModulePath("sql", str(root / "sql")), LoRAModulePath("chat", str(root / "chat"), BASE)]
    loras = load_lora_modules(engine, modules)
    assert [(r.lora_name, r.lora_int_id) for r in loras] == [("sql", 1), ("chat", 2)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        app = build_app(AsyncEngine(engine), served_model_names=[BASE], model_path=tiny_llama, lora_requests=loras)
    with LiveServer(app) as srv:
        yield srv, tiny_llama, root, deltas


@pytest.fixture(scope="module")
def client(setup) -> openai.OpenAI:
    return openai.OpenAI(base_url=setup[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return transformers.AutoTokenizer.from_pretrained(tiny_llama)


def complete(client: openai.OpenAI, model: str, **kw) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0.0,
                                     extra_body={"ignore_eos": True}, **kw)


def post(setup, route: str, body: dict) -> httpx.Response:
    return httpx.post(setup[0].url + route, json=body, timeout=60)


def test_completions_with_adapters_equal_merged_transformers(setup, client, tok):
    _, path, _, deltas = setup
    texts = {}
    for model, d in ((BASE, None), ("sql", deltas["sql"]), ("chat", deltas["chat"])):
        out = complete(client, model)
        assert out.model == model
        want = tok.decode(merged_greedy(path, d, tok, PROMPT, N), skip_special_tokens=True)
        assert out.choices[0].text == want, model
        texts[model] = out.choices[0].text
    assert len(set(texts.values())) == 3  # each adapter changes the output; the base has none
    # streamed: the same text, every chunk naming the adapter
    chunks = list(complete(client, "sql", stream=True))
    assert {c.model for c in chunks} == {"sql"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == texts["sql"]
    beams = client.completions.create(model="sql", prompt=PROMPT, n=2, max_tokens=4,
                                      extra_body={"use_beam_search": True})
    assert beams.model == "sql" and len(beams.choices) == 2


def test_chat_with_adapter(client):
    def chat(model: str, **kw):  # noqa: ANN202
        return client.chat.completions.create(model=model, messages=CHAT, max_tokens=N, temperature=0.0,
                                              extra_body={"ignore_eos": True}, **kw)

    base, adapted = chat(BASE), chat("chat")
    assert adapted.model == "chat" and base.model == BASE
    assert adapted.choices[0].message.content != base.choices[0].message.content
    chunks = list(chat("chat", stream=True))
    assert {c.model for c in chunks} == {"chat"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == adapted.choices[0].message.content


def test_models_lists_adapters(setup, client):
    _, path, root, _ = setup
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert list(cards)[:3] == [BASE, "sql", "chat"]
    assert cards[BASE]["root"] == path and cards[BASE]["parent"] is None
    for name in ("sql", "chat"):
        assert cards[name]["object"] == "model" and cards[name]["parent"] == BASE
        assert cards[name]["root"] == str(root / name)
    assert client.models.retrieve("sql").model_dump()["parent"] == BASE


def test_runtime_load_use_unload(setup, client, tok):
    _, path, root, _ = setup
    r = post(setup, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(root / "late")})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert "late" in [m.id for m in client.models.list().data]
    out = complete(client, "late")
    assert out.model == "late" and out.choices[0].text != complete(client, BASE).choices[0].text
    # unloading while a request still runs with it is refused; once it is gone, unload works
    long = client.completions.create(model="late", prompt=PROMPT, max_tokens=240, temperature=0.0, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(long))
    busy = post(setup, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"], busy.text
    long.close()
    r = post(setup, "/v1/unload_lora_adapter", {"lora_name": "late", "lora_int_id": 99})
    for _ in range(50):  # the closed stream's abort reaches the engine thread first
        if r.status_code != 409:
            break
        time.sleep(0.05)
        r = post(setup, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "late")
    assert e.value.body["code"] == "model_not_found"
    assert "late" not in [m.id for m in client.models.list().data]


def test_runtime_errors(setup, client, tmp_path):
    _, _, root, _ = setup
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "nope")
    assert e.value.body["code"] == "model_not_found"
    r = post(setup, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(root / "sql")})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = post(setup, "/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": str(root / "sql")})
    assert r.status_code == 400 and "base model" in r.json()["error"]["message"]
    r = post(setup, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    r = post(setup, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(root / "wide")})
    assert r.status_code == 400 and "max_lora_rank=8" in r.json()["error"]["message"]
    assert {"gone", "wide"}.isdisjoint(m.id for m in client.models.list().data)
    r = post(setup, "/v1/unload_lora_adapter", {"lora_name": "never"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'never' cannot be found."
    r = post(setup, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert complete(client, "sql").model == "sql"  # the engine lives on


def test_runtime_routes_need_the_env_var(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    with LiveServer(build_app(AsyncEngine(FakeEngine()))) as srv:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = httpx.post(srv.url + route, json={"lora_name": "a", "lora_path": "/x"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "route_not_found"


def test_start_up_errors(setup, tmp_path):
    with pytest.raises(ValueError, match="needs --enable-lora"):
        load_lora_modules(FakeEngine(), [LoRAModulePath("a", "/x")])
    with pytest.raises(ValueError, match="base_model_name 'other'"):
        build_app(AsyncEngine(FakeEngine()), served_model_names=["m"],
                  lora_requests=[LoRARequest("a", 1, "/x", "other")])
    # a bad folder or rank names the module (an engine stand-in with the real adapter checks)
    model_config = setup[0].app.state.engine.call_threadsafe(lambda e: e.model_config, timeout=30)

    def engine() -> SimpleNamespace:
        manager = LoRAManager(model_config, LoRAConfig(max_loras=2, max_lora_rank=8))
        return SimpleNamespace(config=SimpleNamespace(enable_lora=True), add_lora=manager.add)

    root = setup[2]
    with pytest.raises(ValueError, match=r"--lora-modules gone=.*does not exist"):
        load_lora_modules(engine(), [LoRAModulePath("sql", str(root / "sql")),
                                     LoRAModulePath("gone", str(tmp_path / "missing"))])
    with pytest.raises(ValueError, match=r"--lora-modules wide=.*exceeds max_lora_rank=8"):
        load_lora_modules(engine(), [LoRAModulePath("wide", str(root / "wide"))])
