"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis, valid and invalid bodies, a
bounded number of examples per route): no 5xx, no crash, and every error in OpenAI's error JSON.
Model-free (the fake engine), so the whole run stays well under a minute."""

from __future__ import annotations

import json

import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from jaxengine.server.api_server import build_app  # noqa: E402
from jaxengine.async_engine import AsyncEngine  # noqa: E402
from jaxengine.server.limits import ServerLimits  # noqa: E402
from tests.server.conftest import LiveServer  # noqa: E402
from tests.server.fake_engine import FakeEngine  # noqa: E402

MAX_EXAMPLES = 40  # per route and generation mode

schema = schemathesis.pytest.from_fixture("api_schema")
SEEN: dict[str, set[int]] = {}  # "METHOD path" -> statuses answered (the coverage check below reads it)


@pytest.fixture(scope="module")
def live():
    # A vocabulary below the surrogate range, as real tokenizers' decoded text is valid Unicode.
    engine = FakeEngine(max_model_len=64, max_num_seqs=4, num_blocks=10_000, vocab_size=0xD800)
    app = build_app(AsyncEngine(engine), served_model_names=["m"], limits=ServerLimits(max_request_body_bytes=2**20))
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(live):
    loaded = schemathesis.openapi.from_url(live.url + "/openapi.json")
    loaded.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
    return loaded


def assert_openai_error(body: bytes, status: int) -> None:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")


@schema.parametrize()
@hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_fuzz_api(case, live):
    response = case.call(base_url=live.url, timeout=20)
    status = response.status_code
    SEEN.setdefault(f"{case.method} {case.path}", set()).add(status)
    assert status < 500, f"{case.method} {case.path} -> {status}: {response.text[:500]}\n{case.body!r}"[:2000]
    if status >= 400:
        assert_openai_error(response.content, status)
    elif case.body is not None and isinstance(case.body, dict) and case.body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
    assert live.app.state.engine.is_alive


def test_fuzzing_reached_both_valid_and_invalid_requests():
    """Guards the fuzz run itself: generation produced requests the server served and ones it refused."""
    routes = ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize")
    for route in routes:  # random `model` names are mostly 404s, so 200s are not guaranteed per route
        assert any(400 <= s < 500 for s in SEEN.get(route, set())), (route, SEEN)
    assert any(200 in SEEN.get(route, set()) for route in routes), SEEN
