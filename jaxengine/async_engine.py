"""The engine loop: one background thread owns the (not thread-safe) `LLMEngine`; asyncio talks to it.

One request's life:
1. A handler calls `await async_engine.add(request_id, prompt, params)`. That puts an `_Add`
   command on a thread-safe queue and waits for the engine thread's answer: an acknowledgement,
   or the `ValueError` that `LLMEngine.add_request` raised (bad input, answered with HTTP 400).
2. The engine thread drains its command queue between steps (blocking only while it has nothing
   to do) and steps while any request is unfinished. Continuous batching is the engine's own: a
   request added between two steps joins the next one.
3. After each step the thread hands all of the step's `RequestOutput`s to the event loop in ONE
   `loop.call_soon_threadsafe` call; on the loop they are routed to their `RequestStream`s.
4. The handler iterates its `RequestStream`. Outputs are cumulative (full text and token ids so
   far), so a stream keeps only the newest one: a slow consumer skips intermediate states and
   never falls behind.
5. A handler that stops early (client disconnected, task cancelled) calls `stream.close()`, which
   sends `_Abort`: the engine drops the request and its KV blocks return to the pool.
If processing one request's output raises (its detokenizer, say), the engine finishes that request
alone (finish_reason "error", `LLMEngine.request_errors`) and its stream raises `RequestFailedError`.
Across hosts (`channel`, a `jaxengine.distributed.StepChannel`): before each iteration the thread
broadcasts the adds and aborts it applied, so the other processes' engines take the same steps
(see jaxengine/distributed.py); while idle it sends an empty iteration every `HEARTBEAT_S`.
Beam search (`beam_search`) is a loop on the event loop: each step adds one one-token request per
live beam, all at once (they share an engine step with each other and with every other request),
and awaits their final outputs; nothing blocks the engine thread or other requests.
If a step raises, the engine is dead: every open stream (and every later `add`) raises
`EngineDeadError`, `on_death` is called (the server then exits non-zero), and `is_alive` is False.

`shutdown(drain_timeout)` stops accepting requests, lets in-flight ones finish for up to
`drain_timeout` seconds, aborts the rest (their streams end with finish_reason "abort") and joins
the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

from jaxengine.beam_search import BeamSearch, BeamSearchOutput, PromptIds
from jaxengine.outputs import CompletionOutput, RequestOutput
from jaxengine.sampling_params import BeamSearchParams, SamplingParams
from jaxengine.exceptions import EngineDeadError, RequestFailedError

if TYPE_CHECKING:
    from jaxengine.engine import LLMEngine
    from jaxengine.lora import LoRARequest

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict[str, object]


class OutputObserver(Protocol):
    """Sees every output and every step on the engine thread (the server's Prometheus metrics).
    Its methods run inside the loop, so they must be O(1) per call and never block."""

    def on_step(self, stats: dict[str, float]) -> None: ...  # after each `engine.step()`

    def on_output(self, output: RequestOutput, new_tokens: int, first: bool) -> None: ...

    def on_finished(self, output: RequestOutput) -> None: ...


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    stream: RequestStream
    arrival_time: float
    lora_request: LoRARequest | None = None  # loaded by the engine on first use (a bad one: ValueError)


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Call:
    fn: Callable[[LLMEngine], object]
    future: concurrent.futures.Future  # thread-safe: completed by the engine thread itself


class _Stop:
    pass


_Command = _Add | _Abort | _Call | _Stop
_ACK = object()  # the engine accepted an _Add


@dataclasses.dataclass
class _Live:
    """Engine-thread bookkeeping of one accepted request."""

    stream: RequestStream
    n: int  # sequences of the request
    last: RequestOutput | None = None
    tokens: int = 0  # output tokens already reported to the observer


class RequestStream:
    """The outputs of one request: `async for output in stream`. Only the newest undelivered output
    is kept (outputs are cumulative, so nothing is lost). Owned by the event loop; the engine thread reaches it only through `_deliver` scheduled
    with `call_soon_threadsafe`. Iteration ends after the output with `finished=True`.
    """

    def __init__(self, request_id: str, engine: AsyncEngine, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self._ack: asyncio.Future = loop.create_future()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()
        self._done = False  # the engine is finished with this request (finished, aborted or dead)
        self._consumed = False  # the consumer saw the final output or error

    # -- engine side (called on the loop) -------------------------------------------------
    def _deliver(self, item: object) -> None:
        if item is _ACK:
            if not self._ack.done():
                self._ack.set_result(None)
            return
        if isinstance(item, BaseException):
            if not self._ack.done():
                self._ack.set_exception(item)
                self._ack.exception()  # mark retrieved: the adder may already be gone
            else:
                self._error = item
            self._finish()
        else:
            assert isinstance(item, RequestOutput)
            self._latest = item
            if item.finished:
                self._finish()
        self._wakeup.set()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._engine._stream_done(self)

    # -- consumer side ------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                if out.finished:
                    self._consumed = True
                return out
            if self._error is not None:
                err, self._error = self._error, None
                self._consumed = True
                raise err
            if self._consumed or (self._done and self._error is None):
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()

    def close(self) -> None:
        """Stop following the request; aborts it in the engine if it is still running."""
        self._consumed = True
        if not self._done:
            self._engine.abort(self.request_id)
            self._finish()



async def wait_for_either(a: asyncio.Event, b: asyncio.Event, timeout: float) -> None:
    """Waits until either event is set, or `timeout` seconds (a shutdown's drain)."""
    waits = {asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())}
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()

class AsyncEngine:
    """Runs an `LLMEngine` in one background thread; `add` / `generate` / `abort` from asyncio."""

    HEARTBEAT_S = 1.0  # with a channel: the longest the other processes wait for an iteration

    def __init__(self, engine: LLMEngine, *, observer: OutputObserver | None = None,
                 on_death: Callable[[BaseException], None] | None = None, channel=None):
        self.engine = engine
        self.channel = channel
        self._events: list[tuple] = []  # engine thread: what this iteration applied, for `channel`
        self.observer = observer
        self.on_death = on_death
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._open: dict[str, RequestStream] = {}  # loop only: streams the engine still works on
        self._idle: asyncio.Event | None = None
        self._hurry: asyncio.Event | None = None  # set: stop draining, abort now
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._accepting = False
        self._stats: dict[str, float] = dict(engine.stats())

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the loop thread; call from the event loop that will call `add`."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()
        self._accepting = True
        self._thread = threading.Thread(target=self._thread_main, name=self._thread_name, daemon=True)
        self._thread.start()

    _thread_name = "jaxengine-loop"

    def _thread_main(self) -> None:
        """The background thread `start` runs: here the engine loop (a subclass may run another)."""
        self._run()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the loop thread died (None while it runs or after a clean shutdown)."""
        return self._error

    @property
    def num_open_requests(self) -> int:
        return len(self._open)

    def stats(self) -> dict[str, float]:
        """The engine's stats as of its last loop iteration (never touches the engine)."""
        return self._stats

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Finishes or aborts every in-flight request, then stops and joins the loop thread."""
        self._accepting = False
        if self._thread is None or not self._thread.is_alive():
            return
        if drain_timeout > 0 and self._open and self.is_alive:
            assert self._idle is not None and self._hurry is not None
            await wait_for_either(self._idle, self._hurry, drain_timeout)
            if self._open:
                logger.info("aborting %d request(s) still running", len(self._open))
        for request_id in list(self._open):
            self._commands.put(_Abort(request_id))
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, 30.0)
        if self._thread.is_alive():
            logger.warning("the engine loop did not stop within 30 s")

    def hurry_shutdown(self) -> None:
        """Makes a `shutdown` that is draining abort what is left now. Safe from any thread and
        from signal handlers."""
        if self._loop is not None and self._hurry is not None:
            try:
                self._loop.call_soon_threadsafe(self._hurry.set)
            except RuntimeError:  # the loop is closed
                pass

    # -- requests -------------------------------------------------------------------------------
    async def add(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                  arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Submits a request (with a LoRA adapter: `lora_request`); returns its stream once the
        engine accepted it.

        Raises `ValueError` for input the engine rejects (an adapter it cannot load included) and
        `EngineDeadError` if the loop is gone.
        """
        self._check_alive()
        if request_id in self._open:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None and hasattr(self.engine, "compile_grammar"):
            # Compiled (and cached) here, in a worker thread, so the engine thread never waits for
            # a grammar; an invalid schema, regex or grammar is this call's ValueError.
            await asyncio.to_thread(self.engine.compile_grammar, params.structured_outputs)
        assert self._loop is not None and self._idle is not None
        stream = RequestStream(request_id, self, self._loop)
        self._open[request_id] = stream
        self._idle.clear()
        self._commands.put(_Add(request_id, prompt, params, stream,
                                arrival_time if arrival_time is not None else time.monotonic(), lora_request))
        if self._error is not None:  # died after the check above: nobody will answer the _Add
            stream._deliver(EngineDeadError(str(self._error)))
        try:
            await stream._ack
        except asyncio.CancelledError:
            self.abort(request_id)  # queued behind the _Add, so the engine drops it right after
            raise
        return stream

    async def generate(self, prompt: PromptInput, params: SamplingParams, request_id: str,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative outputs until it finishes; aborts it if left early."""
        stream = await self.add(request_id, prompt, params, lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def beam_search(self, prompts: list[PromptIds], params: BeamSearchParams, request_id: str,
                          lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search over the prompts (see jaxengine/beam_search.py), one batch of
        one-token requests per step (ids `<request_id>-<step>-<beam>`). Raises `ValueError` for bad
        input; cancelled, it aborts the step's requests."""
        self._check_alive()
        engine = self.engine
        search = BeamSearch(prompts, params, engine.eos_token_ids, max_model_len=engine.config.max_model_len,
                            max_logprobs=engine.config.max_logprobs)
        step_params = search.step_params()
        while not search.done:
            rids = [f"{request_id}-{search.step}-{k}" for k in range(len(search.pending()))]
            tasks = [asyncio.ensure_future(self._final_output({"prompt_token_ids": ids}, step_params, rid,
                                                              lora_request))
                     for rid, ids in zip(rids, search.pending())]
            try:
                outs = await asyncio.gather(*tasks)
            finally:
                for t in tasks:  # after an error or a cancellation: the rest are aborted
                    t.cancel()
            search.advance([out.outputs[0].logprobs[0] for out in outs])
        return search.outputs(engine.tokenizer)

    async def _final_output(self, prompt: PromptInput, params: SamplingParams, request_id: str,
                            lora_request: LoRARequest | None = None) -> RequestOutput:
        final = None
        async for out in self.generate(prompt, params, request_id, lora_request):
            final = out
        if final is None or final.outputs[0].finish_reason not in ("stop", "length") or not final.outputs[0].logprobs:
            reason = final.outputs[0].finish_reason if final is not None else "no output"
            raise RequestFailedError(f"request {request_id} ended with {reason}")
        return final

    def abort(self, request_id: str) -> None:
        """Aborts a request (unknown or finished ids are ignored). Safe from any thread."""
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Runs `fn(engine)` on the engine thread between steps (for inspection and tests)."""
        return await asyncio.wrap_future(self._submit_call(fn))

    def call_threadsafe(self, fn: Callable[[LLMEngine], object], timeout: float | None = None) -> object:
        """`call` for other threads: blocks until the engine thread ran `fn(engine)`."""
        return self._submit_call(fn).result(timeout)

    def _submit_call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        if self._error is not None or self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        if self._error is not None and not future.done():  # died after the check: nobody will run it
            future.set_exception(EngineDeadError("the engine loop died"))
        return future

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {type(self._error).__name__}: {self._error}")
        if not self._accepting or self._thread is None:
            raise EngineDeadError("the engine is not accepting requests (not started or shutting down)")

    def _stream_done(self, stream: RequestStream) -> None:
        if self._open.get(stream.request_id) is stream:
            del self._open[stream.request_id]
            if not self._open and self._idle is not None:
                self._idle.set()

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                deliveries: list[tuple[RequestStream, object]] = []
                running = self._drain_commands(block=not engine.has_unfinished_requests(), out=deliveries)
                if self.channel is not None:
                    events, self._events = self._events, []
                    self.channel.exchange(events if running else events + [("stop",)])
                if not running:
                    self._send(deliveries)
                    break
                stepped = engine.has_unfinished_requests()
                if stepped:
                    for output in engine.step():
                        self._on_output(output, deliveries)
                self._stats = dict(engine.stats())
                if stepped and self.observer is not None:
                    self.observer.on_step(self._stats)
                self._send(deliveries)
        except BaseException as e:  # noqa: BLE001 - any failure ends the engine; it is reported, not lost
            self._error = e
            logger.exception("the engine loop died")
            self._fail_all(e)
            if self.on_death is not None:
                try:
                    self.on_death(e)
                except Exception:  # noqa: BLE001
                    logger.exception("on_death callback failed")

    def _drain_commands(self, block: bool, out: list) -> bool:
        """Applies queued commands; False once a stop command arrived."""
        timeout = self.HEARTBEAT_S if self.channel is not None else None
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return True
            block = False
            if isinstance(cmd, _Stop):
                return False
            self._apply(cmd, out)

    def _apply(self, cmd: _Command, out: list) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            try:
                engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                   lora_request=cmd.lora_request)
            except ValueError as e:  # the caller's input (or adapter): answered with a 400, the loop goes on
                out.append((cmd.stream, e))
                return
            self._live[cmd.request_id] = _Live(cmd.stream, cmd.params.n)
            if self.channel is not None:
                self._events.append(("add", cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time,
                                     cmd.lora_request))
            out.append((cmd.stream, _ACK))
        elif isinstance(cmd, _Abort):
            live = self._live.pop(cmd.request_id, None)
            if live is None:
                return
            engine.abort_request(cmd.request_id)
            if self.channel is not None:
                self._events.append(("abort", cmd.request_id))
            final = _aborted(live.last, cmd.request_id, live.n)
            if self.observer is not None:
                self.observer.on_finished(final)
            out.append((live.stream, final))
        elif isinstance(cmd, _Call):
            if not cmd.future.set_running_or_notify_cancel():
                return
            try:
                cmd.future.set_result(cmd.fn(engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                cmd.future.set_exception(e)

    def _on_output(self, output: RequestOutput, out: list) -> None:
        live = self._live.get(output.request_id)
        if live is None:  # not ours (cannot happen while only this class adds requests)
            return
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if self.observer is not None:
            self.observer.on_output(output, tokens - live.tokens, live.last is None)
            if output.finished:
                self.observer.on_finished(output)
        live.tokens, live.last = tokens, output
        if output.finished:
            del self._live[output.request_id]
            errors = getattr(self.engine, "request_errors", None)
            error = errors.pop(output.request_id, None) if errors else None
            if error is not None:  # this request alone failed in the engine (see LLMEngine._fail_request)
                out.append((live.stream, RequestFailedError(error)))
                return
        out.append((live.stream, output))

    def _send(self, deliveries: list) -> None:
        if deliveries and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(_dispatch, deliveries)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    def _fail_all(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine loop died: {type(error).__name__}: {error}")
        deliveries: list = [(live.stream, dead) for live in self._live.values()]
        self._live.clear()
        while True:  # commands nobody will execute
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                deliveries.append((cmd.stream, dead))
            elif isinstance(cmd, _Call) and not cmd.future.done():
                cmd.future.set_exception(dead)
        self._send(deliveries)


def _dispatch(deliveries: list[tuple[RequestStream, object]]) -> None:
    """On the event loop: hands each delivered item to its stream."""
    for stream, item in deliveries:
        stream._deliver(item)


def _aborted(last: RequestOutput | None, request_id: str, n: int) -> RequestOutput:
    """The final output of an aborted request: its last state, unfinished choices marked "abort"."""
    if last is None:  # aborted before its first token
        outs = [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                 finish_reason="abort") for i in range(n)]
        return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], prompt_logprobs=None,
                             outputs=outs, finished=True)
    outs = [c if c.finish_reason is not None else dataclasses.replace(c, finish_reason="abort")
            for c in last.outputs]
    return dataclasses.replace(last, outputs=outs, finished=True)


__all__ = ["AsyncEngine", "RequestStream", "EngineDeadError", "OutputObserver"]
