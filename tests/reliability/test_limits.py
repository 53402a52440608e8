"""Hostile and oversized input gets a 4xx in OpenAI's error JSON (never a 5xx, a hang or a crash),
and the server keeps serving. Model-free (the fake engine), so it runs in seconds."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from jaxengine.server.api_server import build_app
from jaxengine.async_engine import AsyncEngine
from jaxengine.server.limits import ServerLimits, check_json_body
from tests.server.conftest import LiveServer
from tests.server.fake_engine import FakeEngine

LIMIT = 64 * 1024
OK = {"model": "m", "prompt": "hi", "max_tokens": 3}


@pytest.fixture(scope="module")
def server():
    app = build_app(AsyncEngine(FakeEngine(max_model_len=64, num_blocks=1000)), served_model_names=["m"],
                    limits=ServerLimits(max_request_body_bytes=LIMIT))
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = None, text: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    if text is not None:
        assert text in err["message"], err["message"]
    return err


def post_raw(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def test_body_over_the_limit_is_413(http):
    big = {**OK, "prompt": "x" * (LIMIT + 1)}
    err = assert_error(http.post("/v1/completions", json=big), 413, text="--max-request-body-bytes")
    assert err["code"] == "request_too_large"
    # chunked (no Content-Length): counted while reading
    chunks = (json.dumps(big).encode()[i:i + 4096] for i in range(0, LIMIT + 8192, 4096))
    assert_error(http.post("/v1/completions", content=chunks, headers={"content-type": "application/json"}), 413)
    # just under the limit is served
    fits = {**OK, "prompt": "x" * 40}
    assert http.post("/v1/completions", json=fits).status_code == 200


def test_declared_length_is_refused_before_reading(server):
    """A client that announces a huge body and sends nothing gets its 413 at once."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")
        t0 = time.monotonic()
        head = s.recv(4096)
        assert time.monotonic() - t0 < 5
    assert head.startswith(b"HTTP/1.1 413"), head[:100]


@pytest.mark.parametrize("body, text", [
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "not valid UTF-8"),
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "surrogate"),
    (b'{"prompt": "a\\udc00", "max_tokens": 2}', "surrogate"),
    (b'{"prompt": "a", "\\ud800": 1}', "surrogate"),
    (b'{"prompt": "a", "stop_token_ids": ' + b"[" * 40 + b"]" * 40 + b"}", "nested too deeply"),
    (b'{"prompt": "a", "stop_token_ids": ' + b"[" * 20000 + b"]" * 20000 + b"}", "nested too deeply"),
], ids=["utf8", "high-surrogate", "low-surrogate", "surrogate-key", "depth-40", "depth-20000"])
def test_hostile_bytes_are_400(http, body, text):
    assert_error(post_raw(http, "/v1/completions", body), 400, text=text)


def test_hostile_bytes_on_every_post_route(http):
    for path in ("/v1/chat/completions", "/tokenize", "/detokenize"):
        assert_error(post_raw(http, path, b'{"prompt": "\\udfff"}'), 400, text="surrogate")


def test_valid_unicode_passes():
    assert check_json_body('{"prompt": "\\ud83d\\ude00 caf\\u00e9 \u4e2d"}'.encode(), 32) is None
    assert check_json_body(b'{"a": [[[[1]]]]}', 32) is None
    assert check_json_body(b"not json", 32) is None  # left to the validator, which names the position


@pytest.mark.parametrize("change, param, text", [
    ({"prompt": ["a"] * 257}, "prompt", "at most 256"),
    ({"stop": ["s"] * 17}, "stop", "at most 16"),
    ({"stop": "s" * 513}, "stop", "512 characters"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids", "at most 256"),
    ({"n": 5}, "n", "max_num_seqs"),
    ({"n": 0}, "n", None),
    ({"max_tokens": 100}, "max_tokens", "maximum context length"),
    ({"max_tokens": 2**40}, "max_tokens", None),
    ({"prompt": "x" * 70}, "prompt", "maximum context length"),
    ({"logprobs": -1}, "logprobs", None),
    ({"logprobs": 21}, "logprobs", None),
    ({"seed": 2**70}, "seed", None),
    ({"top_k": 2**40}, "top_k", None),
    ({"prompt": [2**40]}, "prompt", None),
    ({"min_tokens": 2**33}, "min_tokens", None),
])
def test_completion_limits(http, change, param, text):
    assert_error(http.post("/v1/completions", json={**OK, **change}), 400, param=param, text=text)


@pytest.mark.parametrize("change, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
])
def test_chat_limits(http, change, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **change}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)


def test_still_serving_after_all_that(http):
    r = http.post("/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        ServerLimits(max_request_body_bytes=0)
    with pytest.raises(ValueError, match="max_queued_requests"):
        ServerLimits(max_queued_requests=-1)
    assert ServerLimits(max_queued_requests=0).max_queued_requests == 0


def test_limit_flags_and_config_keys(tmp_path):
    from jaxengine.cli import build_parser
    from jaxengine.server.cli import ServerSettings, resolve_args

    def settings(argv: list[str]) -> ServerSettings:
        return ServerSettings.from_args(resolve_args(build_parser().parse_args(["serve", *argv])))

    default = settings([]).limits
    assert default.max_request_body_bytes == 8 * 2**20 and default.max_queued_requests is None
    got = settings(["--max-request-body-bytes", "1000", "--max-queued-requests", "3"]).limits
    assert (got.max_request_body_bytes, got.max_queued_requests) == (1000, 3)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-queued-requests: 0\nmax_request_body_bytes: 2048\n")
    got = settings(["--config", str(cfg)]).limits
    assert (got.max_request_body_bytes, got.max_queued_requests) == (2048, 0)
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        settings(["--max-request-body-bytes", "0"])
