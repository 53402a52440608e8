"""Serving a `PoolingEngine` from asyncio: one worker thread runs the requests, one at a time.

One request's life:
1. A handler awaits `AsyncPoolingEngine.embed(prompts, params)` (or `encode`, `classify`,
   `score`). The call is queued on an executor with ONE thread, so requests run one after another
   on the device (each request's prompts are batched by `PoolingEngine.run`) and the event loop
   never waits on tokenization, the device or the finishing.
2. On that thread the engine validates the input (a `ValueError`, HTTP 400, comes back to the
   awaiting handler), runs it and finishes the vectors; the observer (the server's metrics) counts
   the request there.
3. The outputs come back to the handler, which shapes the response.
A handler cancelled before its call started (client gone, shutdown) drops it from the queue; one
already running finishes on the thread and its result is discarded.

`shutdown(drain_timeout)` stops accepting requests, lets queued ones finish for up to
`drain_timeout` seconds, cancels what has not started and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from jaxengine.async_engine import wait_for_either
from jaxengine.exceptions import EngineDeadError
from jaxengine.outputs import PoolingRequestOutput
from jaxengine.pooling import PoolingEngineBase, PromptInput
from jaxengine.pooling_params import PoolingParams

logger = logging.getLogger(__name__)


class PoolingObserver(Protocol):
    """Sees each finished pooling request on the worker thread (the server's metrics); O(1)."""

    def on_pooled(self, num_prompts: int, prompt_tokens: int, seconds: float) -> None: ...


class AsyncPoolingEngine:
    """Runs a `PoolingEngine` on one worker thread; `embed` / `encode` / `classify` / `score`
    from asyncio. The same lifecycle as `AsyncEngine` (start, is_alive, shutdown), so one app
    serves either."""

    def __init__(self, engine: PoolingEngineBase, *, observer: PoolingObserver | None = None):
        self.engine = engine
        self.observer = observer
        # AsyncEngine's hook for a dead engine loop; never called here (a failing request fails alone).
        self.on_death: Callable[[BaseException], None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._accepting = False
        self._open = 0  # loop only: requests queued or running
        self._running = 0  # worker thread only: 1 while a request runs
        self._idle: asyncio.Event | None = None
        self._hurry: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the worker; call from the event loop that will await the tasks."""
        if self._executor is not None:
            raise RuntimeError("the pooling worker is already started")
        self._loop = asyncio.get_running_loop()
        self._idle, self._hurry = asyncio.Event(), asyncio.Event()
        self._idle.set()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxengine-pool")
        self._accepting = True

    @property
    def is_alive(self) -> bool:
        return self._executor is not None and self._accepting

    @property
    def error(self) -> BaseException | None:
        """Always None: a failing request fails alone (HTTP 500); the worker lives on."""
        return None

    @property
    def num_open_requests(self) -> int:
        return self._open

    def stats(self) -> dict[str, float]:
        """What /metrics reads: the running request and those queued behind it."""
        running = self._running
        return {"num_running": running, "num_waiting": max(self._open - running, 0)}

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Lets queued requests finish for up to `drain_timeout` s, cancels the rest, joins the thread."""
        self._accepting = False
        if self._executor is None:
            return
        if drain_timeout > 0 and self._open:
            assert self._idle is not None and self._hurry is not None
            await wait_for_either(self._idle, self._hurry, drain_timeout)
            if self._open:
                logger.info("cancelling %d pooling request(s) not finished", self._open)
        executor, self._executor = self._executor, None
        await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)

    def hurry_shutdown(self) -> None:
        """Makes a draining `shutdown` stop waiting now. Safe from any thread and signal handlers."""
        if self._loop is not None and self._hurry is not None:
            try:
                self._loop.call_soon_threadsafe(self._hurry.set)
            except RuntimeError:  # the loop is closed
                pass

    # -- tasks -----------------------------------------------------------------------------------
    async def embed(self, prompts: Sequence[PromptInput], params: PoolingParams) -> list[PoolingRequestOutput]:
        return await self._call(self.engine.embed, prompts, params)

    async def encode(self, prompts: Sequence[PromptInput], params: PoolingParams) -> list[PoolingRequestOutput]:
        return await self._call(self.engine.encode, prompts, params)

    async def classify(self, prompts: Sequence[PromptInput], params: PoolingParams) -> list[PoolingRequestOutput]:
        return await self._call(self.engine.classify, prompts, params)

    async def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
                    params: PoolingParams) -> list[PoolingRequestOutput]:
        return await self._call(self.engine.score, data_1, data_2, params)

    async def _call(self, fn: Callable[..., list[PoolingRequestOutput]], *args: object) -> list[PoolingRequestOutput]:
        if not self.is_alive:
            raise EngineDeadError("the server is shutting down" if self._executor is not None else "not started")
        assert self._idle is not None and self._loop is not None
        self._open += 1
        self._idle.clear()
        try:
            return await self._loop.run_in_executor(self._executor, self._run, fn, args)
        finally:
            self._open -= 1
            if not self._open:
                self._idle.set()

    def _run(self, fn: Callable[..., list[PoolingRequestOutput]], args: tuple) -> list[PoolingRequestOutput]:
        """On the worker thread."""
        self._running = 1
        t0 = time.perf_counter()
        try:
            outs = fn(*args)
        finally:
            self._running = 0
        if self.observer is not None:
            self.observer.on_pooled(len(outs), sum(len(o.prompt_token_ids) for o in outs), time.perf_counter() - t0)
        return outs
