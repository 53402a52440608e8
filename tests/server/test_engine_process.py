"""The engine loop in its own process (`ProcessAsyncEngine`, what `jaxengine serve` runs by default):
the same outputs as the in-process engine, streams that grow as they should (deltas rebuilt into
cumulative outputs), aborts, bad input, `call`, the metrics observer's calls replayed, the child's
death reported to every stream, and the server end to end with the official client."""

from __future__ import annotations

import asyncio
import operator
import os
import signal
import sys
import threading

import httpx
import openai
import pytest

from jaxengine import LLM, BeamSearchParams, SamplingParams
from jaxengine.exceptions import EngineDeadError
from jaxengine.structured_outputs import StructuredOutputsParams
from tests.server.conftest import ENGINE_KW, free_port
from tests.server.test_cli import finish_reason, start, stream_in_background

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4 5 6 7 8"]


class Recorder:
    """An observer that keeps what the engine loop told it."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.first: list[str] = []
        self.finished: dict[str, str | None] = {}
        self.steps = 0

    def on_step(self, stats: dict[str, float]) -> None:
        assert "num_running" in stats
        self.steps += 1

    def on_output(self, output, new_tokens: int, first: bool) -> None:  # noqa: ANN001
        self.tokens[output.request_id] = self.tokens.get(output.request_id, 0) + new_tokens
        if first:
            self.first.append(output.request_id)

    def on_finished(self, output) -> None:  # noqa: ANN001
        self.finished[output.request_id] = output.outputs[0].finish_reason


def test_engine_in_its_own_process(tiny_llama, xla_cache_dir):
    from jaxengine.config import EngineConfig
    from jaxengine.engine_process import ProcessAsyncEngine

    config = EngineConfig(model=tiny_llama, compilation_cache_dir=xla_cache_dir, **ENGINE_KW)
    with pytest.raises(ValueError, match="max_num_seqs"):  # the child's start-up error, raised here
        ProcessAsyncEngine.launch(EngineConfig(model=tiny_llama, compilation_cache_dir=xla_cache_dir,
                                               **{**ENGINE_KW, "max_num_seqs": 0}))
    engine = ProcessAsyncEngine.launch(config)
    assert engine.engine.config.max_model_len == ENGINE_KW["max_model_len"]
    assert engine.engine.tokenizer is not None
    recorder = Recorder()
    engine.observer = recorder
    deaths: list[BaseException] = []
    engine.on_death = deaths.append
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(tiny_llama, compilation_cache_dir=xla_cache_dir, **ENGINE_KW)
    reference = llm.generate(PROMPTS, greedy)
    beams = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    beam_reference = llm.beam_search(PROMPTS[:1], beams)

    async def run() -> None:
        engine.start()

        async def follow(i: int, params: SamplingParams) -> list:
            return [out async for out in engine.generate(PROMPTS[i], params, f"r{i}")]

        streams = await asyncio.gather(*(follow(i, greedy) for i in range(len(PROMPTS))))
        for outs, ref in zip(streams, reference):
            final = outs[-1]
            assert final.finished and final.outputs[0].token_ids == ref.outputs[0].token_ids
            assert final.outputs[0].text == ref.outputs[0].text
            assert final.prompt_token_ids == ref.prompt_token_ids
            for a, b in zip(outs, outs[1:]):  # cumulative: each output extends the one before
                assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
                assert b.outputs[0].text.startswith(a.outputs[0].text)
            assert recorder.tokens[final.request_id] == len(final.outputs[0].token_ids)
            assert recorder.finished[final.request_id] == "length"
        assert sorted(recorder.first) == ["r0", "r1", "r2"] and recorder.steps > 0

        # logprobs and n > 1 travel too
        params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, logprobs=2, ignore_eos=True)
        final = (await follow(0, params))[-1]
        assert [len(c.token_ids) for c in final.outputs] == [12, 12]
        assert all(len(c.logprobs) == 12 and c.cumulative_logprob is not None for c in final.outputs)

        # bad input: a ValueError from `add`, and the engine goes on
        with pytest.raises(ValueError, match="exceeds max_num_seqs"):
            await engine.add("bad", "x", SamplingParams(n=100))

        # an abort: the stream ends, the request leaves the engine
        stream = await engine.add("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        first = await stream.__anext__()
        assert not first.finished
        stream.close()
        for _ in range(200):
            stats = await engine.call(operator.methodcaller("stats"))
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        assert stats["num_running"] == 0 and recorder.finished["long"] == "abort"
        assert engine.num_open_requests == 0

        # call: picklable functions run on the engine; a result that cannot travel is the caller's error
        timing = await engine.call(operator.attrgetter("timing"))
        assert timing["steps"] > 0
        with pytest.raises(TypeError, match="cannot be sent"):
            await engine.call(operator.attrgetter("runner"))
        assert engine.stats()["num_running"] == 0

        # structured outputs: the grammar is compiled in the child; a bad one is this request's ValueError
        choice = SamplingParams(temperature=0, max_tokens=8,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        assert (await follow(1, choice))[-1].outputs[0].text in ("yes", "no")
        with pytest.raises(ValueError):
            await engine.add("bad-regex", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))

        # beam search: one-token requests a step, through the pipe
        [out] = await engine.beam_search([(PROMPTS[0], reference[0].prompt_token_ids)], beams, "beam")
        assert [q.output_text for q in out.sequences] == [q.output_text for q in beam_reference[0].sequences]
        assert engine.num_open_requests == 0
        assert not engine._streams and not engine._outputs  # nothing kept for finished requests

        # the child dies: the open stream and later requests raise EngineDeadError
        stream = await engine.add("doomed", PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exit code"):
            async for _ in stream:
                pass
        for _ in range(100):  # on_death runs on the reader thread, after the streams were told
            if deaths:
                break
            await asyncio.sleep(0.05)
        assert not engine.is_alive and isinstance(deaths[0], EngineDeadError)
        with pytest.raises(EngineDeadError):
            await engine.add("after", "x", greedy)
        await engine.shutdown()

    asyncio.run(run())


TINY_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--num-kv-blocks", "128"]


def serve(model: str, cache: str, *flags: str):  # noqa: ANN201
    """`python -m jaxengine.server` on the tiny model (pass --engine-process for the engine in its own
    process: by default a machine of fewer than 4 CPUs keeps one process)."""
    port = free_port()
    return start([sys.executable, "-m", "jaxengine.server", model, "--port", str(port), *TINY_FLAGS,
                  "--compilation-cache-dir", cache, *flags], port), port


def signal_mid_stream(proc, port: int, max_tokens: int, sig: int, only_engine: bool = False) -> tuple[str, list[str]]:  # noqa: ANN001
    """Sends `sig` to the server and its engine process (`only_engine`: to the engine process
    alone) once a streamed completion is under way; returns the server's stderr and the stream's
    data lines."""
    from jaxengine.benchmarks.soak import _children

    started = threading.Event()
    res = stream_in_background(f"http://127.0.0.1:{port}/v1/completions",
                               {"prompt": "Count:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                               started)
    assert started.wait(60)
    engines = _children(proc.pid)
    assert engines
    for pid in ([] if only_engine else [proc.pid]) + engines:
        os.kill(pid, sig)
    _, err = proc.communicate(timeout=90)
    res["thread"].join(30)
    return err, res["lines"]


def test_serve_with_engine_process(tiny_llama, xla_cache_dir):
    proc, port = serve(tiny_llama, xla_cache_dir, "--engine-process", "--served-model-name", "tiny",
                       "--shutdown-timeout", "60")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
        chunks = list(client.completions.create(model="tiny", prompt="Count:", max_tokens=16, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        whole = client.completions.create(model="tiny", prompt="Count:", max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="x", max_tokens=100_000)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text  # recorded from the engine's messages
        generated = [float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("jaxengine:generation_tokens_total")]
        assert generated and generated[0] >= 4 + 16 + 16
        # SIGTERM to both processes, as systemd's default KillMode sends it: the running request
        # drains, the HTTP process stops the engine process, exits 0
        err, lines = signal_mid_stream(proc, port, 60, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    assert "engine process" in err
    assert lines[-1] == "data: [DONE]" and finish_reason(lines) == "length"


def test_engine_process_death_exits_nonzero(tiny_llama, xla_cache_dir):
    """The engine process killed under a live server: its request gets an error, the server exits 1
    (so a supervisor restarts it)."""
    proc, port = serve(tiny_llama, xla_cache_dir, "--engine-process")
    try:
        err, lines = signal_mid_stream(proc, port, 200, signal.SIGKILL, only_engine=True)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "the engine loop died" in err and "exit code -9" in err
    assert lines[-1] == "data: [DONE]" and "error" in lines[-2]



def test_engine_process_default_follows_the_cpu_count(monkeypatch, capsys):
    """--engine-process / --no-engine-process as given; without either, the engine process only
    where this process may use at least ENGINE_PROCESS_MIN_CPUS CPUs (on two, the two processes
    compete for them), with a log line saying so."""
    import argparse

    from jaxengine.server import cli

    parser = argparse.ArgumentParser()
    cli.add_serve_args(parser)
    assert cli.resolve_args(parser.parse_args(["m"])).engine_process is None
    assert cli.resolve_args(parser.parse_args(["m", "--no-engine-process"])).engine_process is False
    assert cli.usable_cpus() >= 1
    monkeypatch.setattr(cli, "usable_cpus", lambda: 2)
    capsys.readouterr()
    assert cli.wants_engine_process(None) is False
    err = capsys.readouterr().err  # jaxengine's log handler writes to stderr
    assert "2 CPU(s)" in err and "--engine-process" in err
    assert cli.wants_engine_process(True) is True
    monkeypatch.setattr(cli, "usable_cpus", lambda: cli.ENGINE_PROCESS_MIN_CPUS)
    assert cli.wants_engine_process(None) is True
    assert cli.wants_engine_process(False) is False
