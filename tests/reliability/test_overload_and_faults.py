"""Overload and faults: a full queue answers 503 at once (never a hang); more requests than the KV
cache holds wait or are preempted and all finish with their solo outputs; a request whose output
processing raises fails alone (500 / an error event) while every other request goes on."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from jaxengine.server.api_server import build_app
from jaxengine.async_engine import AsyncEngine
from jaxengine.server.limits import ServerLimits
from tests.server.conftest import LiveServer, make_engine
from tests.server.fake_engine import FakeEngine

# A KV pool of 9 usable blocks of 16 tokens: two or three of the requests below fit at once.
TINY_POOL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=10, block_size=16)
PROMPTS = [("The quick brown fox " * k).strip() for k in (1, 3, 6, 9, 2, 8, 4, 7, 5, 10, 1, 6)]
MAX_TOKENS = [24, 16, 32, 20, 28, 12, 24, 18, 30, 16, 8, 24]


async def post_all(url: str, bodies: list[dict], path: str = "/v1/completions") -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        return list(await asyncio.gather(*(c.post(path, json=b) for b in bodies)))


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- back-pressure (model-free) ---------------------------------------------------------------
def fake_server(max_queued: int | None) -> LiveServer:
    engine = FakeEngine(max_model_len=64, max_num_seqs=2, num_blocks=1000, step_delay=0.03)
    return LiveServer(build_app(AsyncEngine(engine), served_model_names=["m"],
                                limits=ServerLimits(max_queued_requests=max_queued)))


def test_full_queue_answers_503_and_recovers():
    body = {"prompt": "hi", "max_tokens": 20}
    with fake_server(max_queued=2) as srv:
        rs = asyncio.run(post_all(srv.url, [body] * 10))
        codes = sorted(r.status_code for r in rs)
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
        assert codes.count(200) >= 4  # max_num_seqs (2) + max_queued_requests (2) fit at once
        for r in rs:
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == "abcdefghijklmnopqrst"
            else:
                err = assert_openai_error(r, 503)
                assert err["code"] == "server_overloaded" and "retry" in err["message"]
                assert r.headers["retry-after"] == "1"
                assert err["type"] == "server_error"
        assert srv.app.state.engine.num_open_requests == 0
        batch = {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}  # 5 prompts > 4 slots
        assert_openai_error(httpx.post(srv.url + "/v1/completions", json=batch, timeout=30), 503)
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200


def test_without_a_queue_limit_everyone_waits_their_turn():
    with fake_server(max_queued=None) as srv:
        rs = asyncio.run(post_all(srv.url, [{"prompt": "hi", "max_tokens": 5}] * 12))
        assert [r.status_code for r in rs] == [200] * 12
        assert {r.json()["choices"][0]["text"] for r in rs} == {"abcde"}


# -- a tiny KV pool and a failing request (the real engine on a tiny model) -------------------
@pytest.fixture(scope="module")
def server(tiny_llama, xla_cache_dir):
    engine = make_engine(tiny_llama, xla_cache_dir, **TINY_POOL)
    with LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"])) as srv:
        yield srv


def engine_call(srv: LiveServer, fn):  # noqa: ANN001, ANN201
    return srv.app.state.engine.call_threadsafe(fn, timeout=30)


def assert_engine_empty(srv: LiveServer) -> None:
    def check(e) -> tuple:  # noqa: ANN001
        return (e.has_unfinished_requests(), e.scheduler.block_manager.num_free_blocks, dict(e.request_errors),
                len(e.outputs.parents), len(e.outputs.child_states), e.scheduler.num_running + e.scheduler.num_waiting)
    assert engine_call(srv, check) == (False, TINY_POOL["num_kv_blocks"] - 1, {}, 0, 0, 0)
    assert srv.app.state.engine.num_open_requests == 0


def bodies() -> list[dict]:
    return [{"prompt": p, "max_tokens": m, "temperature": 0.0, "ignore_eos": True} for p, m in zip(PROMPTS, MAX_TOKENS)]


@pytest.fixture(scope="module")
def solo(server) -> list[dict]:
    """Each request served alone."""
    out = []
    for b in bodies():
        r = httpx.post(server.url + "/v1/completions", json=b, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0])
    return out


def test_more_requests_than_the_kv_cache_holds_all_finish(server, solo):
    rs = asyncio.run(post_all(server.url, bodies()))
    for r, alone, m in zip(rs, solo, MAX_TOKENS):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (alone["text"], "length")
        assert r.json()["usage"]["completion_tokens"] == m
    assert_engine_empty(server)


def poison(engine, marker: str):  # noqa: ANN001, ANN201
    """Makes output processing raise for requests whose prompt text starts with `marker` (as a
    broken detokenizer would); returns the undo."""
    outputs = engine.outputs
    original = outputs._process_token

    def process_token(st, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if st.parent.prompt is not None and st.parent.prompt.startswith(marker):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated detokenizer failure")
        return original(st, *args, **kw)

    outputs._process_token = process_token
    return lambda: setattr(outputs, "_process_token", original)


async def _mixed(url: str, good: list[dict], bad: dict) -> tuple[list[httpx.Response], httpx.Response, list[str]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def stream_bad() -> list[str]:
            async with c.stream("POST", "/v1/completions", json={**bad, "stream": True}) as r:
                assert r.status_code == 200
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]
        results = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in good),
                                       c.post("/v1/completions", json=bad), stream_bad())
    return list(results[:len(good)]), results[len(good)], results[-1]


def test_a_failing_request_fails_alone(server, solo):
    undo = engine_call(server, lambda e: poison(e, "POISON"))
    try:
        bad = {"prompt": "POISON pill", "max_tokens": 10, "temperature": 0.0}
        good, bad_r, bad_events = asyncio.run(_mixed(server.url, bodies()[:6], bad))
    finally:
        engine_call(server, lambda e: undo())
    for r, alone in zip(good, solo):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == alone["text"]
    err = assert_openai_error(bad_r, 500)
    assert "failed in the engine" in err["message"] and "simulated detokenizer failure" in err["message"]
    assert bad_events[-1] == "data: [DONE]"
    last = json.loads(bad_events[-2][len("data: "):])
    assert last["error"]["type"] == "server_error" and "simulated detokenizer failure" in last["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert_engine_empty(server)
    r = httpx.post(server.url + "/v1/completions", json=bodies()[0], timeout=60)
    assert r.json()["choices"][0]["text"] == solo[0]["text"]


def test_engine_level_failure_isolation(server):
    """`LLMEngine.step` itself: the failing request finishes with finish_reason "error" and its
    error in `request_errors`; the other request in the same batch is untouched."""
    def run(e):  # noqa: ANN001, ANN202
        from jaxengine.sampling_params import SamplingParams
        undo = poison(e, "POISON")
        try:
            p = SamplingParams(max_tokens=5, temperature=1.0, seed=7, n=2, ignore_eos=True)
            e.add_request("bad", {"prompt": "POISON x", "prompt_token_ids": [1, 2, 3]}, p)
            e.add_request("good", {"prompt": "fine", "prompt_token_ids": [1, 2, 3]}, p)
            finals = {}
            while e.has_unfinished_requests():
                for o in e.step():
                    if o.finished:
                        finals[o.request_id] = o
            return finals, e.request_errors.pop("bad", None)
        finally:
            undo()
    finals, error = engine_call(server, run)
    assert [c.finish_reason for c in finals["bad"].outputs] == ["error", "error"]
    assert [c.finish_reason for c in finals["good"].outputs] == ["length", "length"]
    assert all(len(c.token_ids) == 5 for c in finals["good"].outputs)
    assert "simulated detokenizer failure" in error
    assert_engine_empty(server)


def test_prompt_logprobs_failure_fails_alone(server):
    """A failure while recording prompt logprobs is isolated the same way."""
    def run(e):  # noqa: ANN001, ANN202
        from jaxengine.sampling_params import SamplingParams
        original = e.outputs._prompt_rows

        def broken(parent, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            if parent.request_id == "bad":
                raise ValueError("simulated prompt logprobs failure")
            return original(parent, *args, **kw)

        e.outputs._prompt_rows = broken
        try:
            p = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
            e.add_request("bad", {"prompt_token_ids": [5, 6, 7, 8]}, p)
            e.add_request("good", {"prompt_token_ids": [5, 6, 7, 8]}, p)
            finals = {}
            while e.has_unfinished_requests():
                for o in e.step():
                    if o.finished:
                        finals[o.request_id] = o
            return finals, e.request_errors.pop("bad", None)
        finally:
            e.outputs._prompt_rows = original
    finals, error = engine_call(server, run)
    assert finals["bad"].outputs[0].finish_reason == "error" and "simulated prompt logprobs" in error
    assert finals["good"].outputs[0].finish_reason == "length" and len(finals["good"].prompt_logprobs) == 4
    assert_engine_empty(server)
