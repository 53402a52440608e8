"""The output worker (jaxengine/output_worker.py) processes a step only while the loop waits,
in order, and hands an exception raised while processing to the loop."""

from __future__ import annotations

import threading
import time

import pytest

from jaxengine.output_worker import OutputWorker


class _Processor:
    def __init__(self) -> None:
        self.seen: list[tuple[object, str]] = []

    def process(self, step):
        if step == "boom":
            raise ValueError("processing failed")
        self.seen.append((step, threading.current_thread().name))
        return f"done {step}"


def test_worker_runs_only_while_the_loop_waits() -> None:
    proc = _Processor()
    worker = OutputWorker(proc)  # type: ignore[arg-type]
    assert worker.take() is None and not worker.busy
    worker.submit("a")
    time.sleep(0.05)
    assert proc.seen == []  # the loop holds the turn: nothing runs beside its Python
    with worker.loop_waiting():  # e.g. waiting for the device
        deadline = time.monotonic() + 5
        while not proc.seen and time.monotonic() < deadline:
            time.sleep(0.001)
    assert proc.seen == [("a", "jaxengine-outputs")]
    assert worker.busy and worker.take() == "done a" and not worker.busy
    worker.submit("b")  # take() lets the worker run while it waits
    assert worker.take() == "done b"
    worker.submit("boom")
    with pytest.raises(ValueError, match="processing failed"):
        worker.take()
    with worker.lock:  # the loop's own calls on the processor hold the same lock as processing
        pass


def test_worker_runs_while_the_runner_launches_a_program(tiny_model_factory, xla_cache_dir) -> None:
    """The engine core hands the worker the turn around each program launch (XLA enqueues with
    the GIL released), and takes it back before its own Python goes on: processing a step
    overlaps the next launch instead of only the wait for tokens."""
    from jaxengine import LLM, SamplingParams

    llm = LLM(tiny_model_factory("llama"), compilation_cache_dir=xla_cache_dir, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, num_kv_blocks=32, block_size=16)
    core = llm.llm_engine.core
    runner = core.runner
    assert runner.launch_window == core.worker.loop_waiting
    processed_in_launch: list[object] = []
    orig = runner._get_forward

    def get_forward(t):
        fn = orig(t)

        def call(*a):
            fut = core.worker._pending
            if fut is not None:  # finishes only if the worker may run now (else: TimeoutError)
                processed_in_launch.append(fut.result(timeout=10))
            return fn(*a)
        return call

    runner._get_forward = get_forward
    try:
        outs = llm.generate(["Hello there", "One two three"], SamplingParams(max_tokens=6, temperature=0.0,
                                                                              ignore_eos=True))
    finally:
        del runner._get_forward
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert processed_in_launch  # steps were pending at launches, and were processed there
    assert core.worker._turn.locked()  # the loop holds the turn again between steps
