"""Output processing off the step loop: one worker thread runs `OutputProcessor.process`.

The engine core hands each resolved step (plain data: the scheduler's rows, the runner's numpy
output, the scheduler's finished ids) to `submit` and goes on; the worker detokenizes, searches
stop strings, records logprobs and builds the `RequestOutput`s while the loop waits for the next
step's tokens (`ModelRunner.collect` waits with the GIL released). The loop takes the result one
step later (`take`), before it hands over the next step, so steps are processed in order and at
most one is pending.

Every other use of the output processor from the loop (adding and aborting requests, prefix-cache
counts) holds `lock`, as `process` does on the worker, so a request is never half added or half
aborted while a step is being processed. What this changes for a request:

- its outputs come back one `step()` later while steps overlap; a step after which nothing is in
  flight on the device is processed at once (the caller drains with `take(wait=True)`);
- a stop string found by the worker is reported then: the scheduler finishes the request one step
  later than before, and the tokens it sampled meanwhile are dropped (the processor ignores tokens
  of a finished child), so text and token ids are exactly what processing in the loop gives;
- an abort between `submit` and `take` drops the aborted request's tokens of the pending step.
"""

from __future__ import annotations

import concurrent.futures
import threading

from jaxengine.output_processor import OutputProcessor, ProcessedStep, ResolvedStep


class OutputWorker:
    """Runs one `OutputProcessor`'s `process` on a background thread, one step at a time."""

    def __init__(self, processor: OutputProcessor) -> None:
        self.processor = processor
        self.lock = threading.Lock()  # held by `process` on the worker, and by the loop's own calls
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxengine-outputs")
        self._pending: concurrent.futures.Future[ProcessedStep] | None = None

    @property
    def busy(self) -> bool:
        """A step was handed over and its result not yet taken."""
        return self._pending is not None

    def submit(self, step: ResolvedStep) -> None:
        """Starts processing `step`; the result of the step before must have been taken."""
        assert self._pending is None, "take() the pending step before submitting another"
        self._pending = self._pool.submit(self._process, step)

    def take(self) -> ProcessedStep | None:
        """The pending step's result (waits for the worker to finish it); None if none is pending.
        An exception raised while processing is raised here."""
        fut, self._pending = self._pending, None
        return fut.result() if fut is not None else None

    def _process(self, step: ResolvedStep) -> ProcessedStep:
        with self.lock:
            return self.processor.process(step)

    def close(self) -> None:
        """Stops the thread (after the pending step, whose result is dropped)."""
        self._pending = None
        self._pool.shutdown(wait=True)
