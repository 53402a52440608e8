"""The engine loop thread on a model-free fake engine: outputs reach their streams, bad input is
answered without stopping anyone else, early exits abort, a crash fails everyone cleanly, and
shutdown drains or aborts what is in flight."""

from __future__ import annotations

import asyncio
import string

import pytest

from jaxengine.sampling_params import SamplingParams
from jaxengine.async_engine import AsyncEngine
from jaxengine.exceptions import EngineDeadError
from jaxengine.server.metrics import ServerMetrics
from tests.server.fake_engine import FakeEngine


def letters(n: int) -> str:
    return "".join(string.ascii_lowercase[i % 26] for i in range(n))


def run(coro_fn, engine: FakeEngine, **kw):  # noqa: ANN001, ANN201
    """Runs `coro_fn(async_engine)` with a started engine loop, then shuts it down."""
    async def main():  # noqa: ANN202
        ae = AsyncEngine(engine, **kw)
        ae.start()
        try:
            return await coro_fn(ae)
        finally:
            await ae.shutdown()
    return asyncio.run(asyncio.wait_for(main(), 30))


def test_generate_streams_cumulative_outputs_until_finished():
    engine = FakeEngine()

    async def body(ae: AsyncEngine):  # noqa: ANN202
        outs = [o async for o in ae.generate("hi", SamplingParams(max_tokens=5), "r1")]
        return outs

    outs = run(body, engine)
    assert outs[-1].finished and outs[-1].outputs[0].text == letters(5)
    assert outs[-1].outputs[0].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert engine.free_blocks == engine.num_blocks


def test_many_concurrent_requests_are_batched_and_complete():
    engine = FakeEngine(num_blocks=64)

    async def body(ae: AsyncEngine):  # noqa: ANN202
        async def one(i: int) -> str:
            final = None
            async for o in ae.generate(f"p{i}", SamplingParams(max_tokens=3 + i % 7, n=1 + i % 2), f"r{i}"):
                final = o
            return [c.text for c in final.outputs]
        results = await asyncio.gather(*(one(i) for i in range(24)))
        assert ae.num_open_requests == 0
        return results

    results = run(body, engine)
    for i, texts in enumerate(results):
        assert texts == [letters(3 + i % 7)] * (1 + i % 2)
    assert engine.steps < 24 * 5  # requests shared steps (continuous batching), not one after another
    assert engine.free_blocks == engine.num_blocks


def test_bad_input_raises_value_error_and_others_continue():
    engine = FakeEngine()

    async def body(ae: AsyncEngine):  # noqa: ANN202
        good = asyncio.ensure_future(_final_text(ae, "ok", SamplingParams(max_tokens=20), "good"))
        with pytest.raises(ValueError, match="empty"):
            await ae.add("bad", [], SamplingParams())
        with pytest.raises(ValueError, match="max_num_seqs"):
            await ae.add("bad2", "x", SamplingParams(n=5, temperature=1.0))
        return await good

    assert run(body, engine) == letters(20)


async def _final_text(ae: AsyncEngine, prompt: str, params: SamplingParams, rid: str) -> str:
    final = None
    async for o in ae.generate(prompt, params, rid):
        final = o
    return final.outputs[0].text


def test_leaving_a_stream_early_aborts_the_request():
    engine = FakeEngine(step_delay=0.005)

    async def body(ae: AsyncEngine):  # noqa: ANN202
        gen = ae.generate("x", SamplingParams(max_tokens=1000), "early")
        async for _ in gen:
            break
        await gen.aclose()
        free = await ae.call(lambda e: (e.free_blocks, list(e.aborted), e.has_unfinished_requests()))
        return free

    free, aborted, unfinished = run(body, engine)
    assert aborted == ["early"] and not unfinished and free == engine.num_blocks


def test_cancelling_while_adding_leaks_nothing():
    engine = FakeEngine(step_delay=0.01)

    async def body(ae: AsyncEngine):  # noqa: ANN202
        blocker = asyncio.ensure_future(_final_text(ae, "busy", SamplingParams(max_tokens=30), "busy"))
        await asyncio.sleep(0.02)
        tasks = [asyncio.ensure_future(ae.add(f"c{i}", "x", SamplingParams(max_tokens=500))) for i in range(5)]
        await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await blocker
        await asyncio.sleep(0.05)
        return await ae.call(lambda e: (e.free_blocks, e.has_unfinished_requests())), ae.num_open_requests

    (free, unfinished), open_requests = run(body, engine)
    assert free == engine.num_blocks and not unfinished and open_requests == 0


def test_engine_death_fails_in_flight_and_later_requests():
    engine = FakeEngine(fail_at_step=4)
    deaths: list[BaseException] = []

    async def body(ae: AsyncEngine):  # noqa: ANN202
        assert ae.is_alive
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            await _final_text(ae, "x", SamplingParams(max_tokens=50), "doomed")
        await asyncio.sleep(0.05)
        assert not ae.is_alive and isinstance(ae.error, RuntimeError)
        with pytest.raises(EngineDeadError):
            await ae.add("late", "x", SamplingParams())
        with pytest.raises(EngineDeadError):
            await ae.call(lambda e: None)

    run(body, engine, on_death=deaths.append)
    assert len(deaths) == 1 and "simulated" in str(deaths[0])


@pytest.mark.parametrize("drain", [5.0, 0.0])
def test_shutdown_drains_or_aborts_in_flight_requests(drain: float):
    engine = FakeEngine(step_delay=0.01)

    async def main():  # noqa: ANN202
        ae = AsyncEngine(engine)
        ae.start()
        stream = await ae.add("r", "x", SamplingParams(max_tokens=20))
        await ae.shutdown(drain_timeout=drain)
        with pytest.raises(EngineDeadError):
            await ae.add("after", "x", SamplingParams())
        final = None
        async for o in stream:
            final = o
        return final

    final = asyncio.run(asyncio.wait_for(main(), 30))
    assert final.finished
    if drain:
        assert final.outputs[0].finish_reason == "length" and final.outputs[0].text == letters(20)
    else:
        assert final.outputs[0].finish_reason == "abort"
    assert engine.free_blocks == engine.num_blocks


def test_metrics_observer_counts_tokens_and_finish_reasons():
    from prometheus_client.parser import text_string_to_metric_families

    engine = FakeEngine(step_delay=0.002)
    holder: dict[str, ServerMetrics] = {}

    async def body(ae: AsyncEngine):  # noqa: ANN202
        metrics = ServerMetrics("fake", 64, ae.stats)
        ae.observer = metrics
        holder["m"] = metrics
        await _final_text(ae, "abc", SamplingParams(max_tokens=6, n=2, temperature=1.0), "a")
        gen = ae.generate("de", SamplingParams(max_tokens=500), "b")
        async for _ in gen:
            break
        await gen.aclose()
        await ae.call(lambda e: None)  # the abort has been applied
        await asyncio.sleep(0.05)

    run(body, engine)
    samples = {}
    for fam in text_string_to_metric_families(holder["m"].render().decode()):
        for s in fam.samples:
            samples[(s.name, s.labels.get("finished_reason"))] = s.value
    assert samples[("jaxengine:prompt_tokens_total", None)] == 3 + 2
    assert samples[("jaxengine:request_success_total", "length")] == 2
    assert samples[("jaxengine:request_success_total", "abort")] == 1
    assert samples[("jaxengine:generation_tokens_total", None)] >= 12 + 1
    assert samples[("jaxengine:time_to_first_token_seconds_count", None)] == 2
    assert samples[("jaxengine:num_requests_running", None)] == 0
