"""Output processing off the step loop: one worker thread runs `OutputProcessor.process`.

The engine core hands each resolved step (plain data: the scheduler's rows, the runner's numpy
output, the scheduler's finished ids) to `submit` and goes on. The worker thread processes it
(detokenizes, searches stop strings, records logprobs, builds the `RequestOutput`s) only while the
loop waits: the loop holds a turn lock while it runs Python and lets go of it around its waits
in C++ with the GIL released (`loop_waiting`): for the next step's tokens (`ModelRunner.collect`)
and while XLA enqueues a program (`ModelRunner.launch_window`: command-buffer updates and the
launch, which for a small model take longer than the device's step), so the worker's Python
never interrupts the loop's (CPython would otherwise switch to the worker in the middle of a
step after 5 ms). When the wait ends the loop takes the turn back, waiting for
the worker to finish if the device was quicker, and takes the result (`take`) before it hands
over the next step: steps are processed in order and at most one is pending.

Every other use of the output processor from the loop (adding and aborting requests, prefix-cache
counts) holds `lock`, as `process` does on the worker, so a request is never half added or half
aborted while a step is being processed. What this changes for a request:

- its outputs come back one `step()` later while steps overlap; a step after which nothing is in
  flight on the device is processed at once (`take` lets go of the turn while it waits);
- a stop string found by the worker is reported then: the scheduler finishes the request one step
  later than before, and the tokens it sampled meanwhile are dropped (the processor ignores tokens
  of a finished child), so text and token ids are exactly what processing in the loop gives;
- an abort between `submit` and `take` drops the aborted request's tokens of the pending step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import weakref
from collections.abc import Iterator

from jaxengine.output_processor import OutputProcessor, ProcessedStep, ResolvedStep


class OutputWorker:
    """Runs one `OutputProcessor`'s `process` on a background thread, one step at a time."""

    def __init__(self, processor: OutputProcessor) -> None:
        self.processor = processor
        self.lock = threading.Lock()  # held by `process` on the worker, and by the loop's own calls
        # Held by the loop while it runs Python; released only while it waits (`loop_waiting`,
        # `take`). The worker processes holding it, so the loop's Python and the worker's never
        # interleave (CPython would otherwise hand the worker the GIL in the middle of a step).
        self._turn = threading.Lock()
        self._turn.acquire()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started on the first submit
        self._pending: concurrent.futures.Future[ProcessedStep] | None = None

    @property
    def busy(self) -> bool:
        """A step was handed over and its result not yet taken."""
        return self._pending is not None

    def submit(self, step: ResolvedStep) -> None:
        """Hands `step` over; the worker processes it during the loop's next wait. The result of
        the step before must have been taken."""
        assert self._pending is None, "take() the pending step before submitting another"
        if self._thread is None:
            # A daemon thread holding only what a job needs: an engine dropped with a step still
            # pending neither keeps its worker alive nor blocks the interpreter's exit.
            self._thread = threading.Thread(target=_serve, args=(self._jobs,), name="jaxengine-outputs",
                                            daemon=True)
            self._thread.start()
            weakref.finalize(self, self._jobs.put, None)
        self._pending = concurrent.futures.Future()
        self._jobs.put((self._pending, self._turn, self.lock, self.processor, step))

    def take(self) -> ProcessedStep | None:
        """The pending step's result (waits for the worker to finish it); None if none is pending.
        An exception raised while processing is raised here."""
        fut, self._pending = self._pending, None
        if fut is None:
            return None
        with self.loop_waiting():
            return fut.result()

    @contextlib.contextmanager
    def loop_waiting(self) -> Iterator[None]:
        """Around a wait of the loop (for the device, or for `take`): the worker may run then;
        on leaving, the loop waits for the step the worker is processing to finish."""
        self._turn.release()
        try:
            yield
        finally:
            self._turn.acquire()


def _serve(jobs: queue.SimpleQueue) -> None:
    """The worker thread: processes each job when the loop gives it the turn; None ends it."""
    while (job := jobs.get()) is not None:
        fut, turn, lock, processor, step = job
        try:
            with turn, lock:
                fut.set_result(processor.process(step))
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which raises it in `take`
            fut.set_exception(e)
        del job, fut, turn, lock, processor, step
