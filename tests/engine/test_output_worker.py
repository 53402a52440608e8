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
