"""Bad input gets OpenAI's error JSON with the right status (and names the offending field) while
the server keeps serving everyone else; `--api-key` guards every /v1 route and nothing else."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from jaxengine.server.api_server import build_app
from jaxengine.async_engine import AsyncEngine
from tests.server.conftest import ENGINE_KW, LiveServer, make_engine

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSGS = [{"role": "user", "content": "hi"}]
LONG = "word " * (ENGINE_KW["max_model_len"] + 10)


@pytest.fixture(scope="module")
def server(tiny_llama, xla_cache_dir):
    engine = make_engine(tiny_llama, xla_cache_dir)
    app = build_app(AsyncEngine(engine), served_model_names=["tiny"], api_key=KEY)
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = None, text: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    if text is not None:
        assert text in err["message"], err["message"]
    return err


COMPLETION_CASES = [
    # (body changes, param, text in the message)
    ({"foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
    ({"suffix": "!"}, "suffix", "suffix"),
    ({"logit_bias": {"fifty": 10}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"logit_bias": {"1000000": 10}}, "logit_bias", "out of vocabulary"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids", "out of vocabulary"),
    ({"bad_words": [""]}, "bad_words", "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"best_of": 3}, "best_of", "best_of"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"max_tokens": -3}, "max_tokens", "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens", None),
    ({"max_tokens": 1.5}, "max_tokens", None),
    ({"n": True}, "n", None),
    ({"temperature": -0.5}, "temperature", "temperature"),
    ({"temperature": "hot"}, "temperature", None),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"n": 9, "temperature": 1.0}, "n", "max_num_seqs"),
    ({"n": 2, "temperature": 0}, "n", "greedy"),
    ({"logprobs": 21}, "logprobs", "logprobs"),
    ({"stop": 5}, "stop", None),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "stream"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs"),
    ({"prompt": 5}, "prompt", "expected one of"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [1, 2, 10**9]}, None, "vocabulary"),
    ({"prompt": LONG}, "prompt", "maximum context length"),
    ({"prompt": "hello", "max_tokens": ENGINE_KW["max_model_len"]}, "max_tokens", "maximum context length"),
]

CHAT_CASES = [
    ({"messages": []}, "messages", None),
    ({"messages": "hi"}, "messages", None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "content part"),
    ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages.0.colour", "colour"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", None),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"messages": [{"role": "user", "content": LONG}]}, "messages", "maximum context length"),
    ({"temperature": 3}, "temperature", "temperature"),
]


def test_bad_input_matrix_while_serving_others(server, http):
    # A long streaming request runs the whole time; it must finish intact.
    good: dict[str, object] = {}

    def stream_good() -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 64,
                                                            "temperature": 0, "ignore_eos": True,
                                                            "stream": True}) as r:
                good["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    t = threading.Thread(target=stream_good)
    t.start()
    base = {"prompt": "hello", "max_tokens": 4}
    for changes, param, text in COMPLETION_CASES:
        assert_error(http.post("/v1/completions", json={**base, **changes}), 400, param, text)
    for changes, param, text in CHAT_CASES:
        assert_error(http.post("/v1/chat/completions", json={"messages": MSGS, **changes}), 400, param, text)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_error(http.post(path, content=b'{"prompt": "x",', headers={"Content-Type": "application/json"}),
                     400, None, "JSON")
        assert_error(http.post(path, json=["not", "an", "object"]), 400)
    err = assert_error(http.post("/v1/completions", json={**base, "model": "gpt-4"}), 404, "model")
    assert err["code"] == "model_not_found"
    assert_error(http.post("/v1/chat/completions", json={"messages": MSGS, "model": "gpt-4"}), 404, "model")
    assert_error(http.get("/v1/nowhere"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={"prompt": 1}), 400, "prompt")
    assert_error(http.post("/tokenize", json={"messages": MSGS, "prompt": "x"}), 400, "prompt", "Unrecognized")
    t.join(120)
    lines = good["lines"]
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
    # after all that, normal requests still work
    ok = http.post("/v1/completions", json={**base, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_openai_client_raises_its_usual_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)


def test_api_key_guards_v1_routes_only(server):
    url = server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"bearer {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
        err = assert_error(httpx.get(url + "/v1/models", headers=headers), 401)
        assert err["code"] == "invalid_api_key"
        assert_error(httpx.post(url + "/v1/completions", headers=headers, json={"prompt": "x"}), 401)
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(url + path).status_code == 200
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    out = good.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, temperature=0)
    assert out.choices[0].message.role == "assistant"
