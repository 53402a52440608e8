"""The engine in its own process (`jaxengine serve`, unless --no-engine-process), as vLLM's EngineCore.

In one process the HTTP server's event loop, the engine loop and the output worker share one GIL;
at high request rates the event loop's streaming (SSE chunks, socket writes) takes GIL time the
engine loop needs to keep the device fed. Here the engine (`LLMEngine`, its loop and its output
worker) runs in a child process started with `spawn`, and the HTTP process keeps only the
requests' streams.

- `ProcessAsyncEngine` (HTTP process) is an `AsyncEngine` whose commands go down a pipe and whose
  outputs come up it; requests, streams, aborts, beam search, `call` and shutdown keep their
  in-process meaning. `engine` is an `EngineInfo`: what the server reads of the engine (config,
  model config, tokenizer), fixed once the child has started.
- `_Core` (child process) is the same `AsyncEngine` engine-thread code run on the child's main
  thread: it applies commands between steps and, after each iteration, sends ONE message with the
  iteration's deliveries, the observer's calls and the engine's stats.
- Outputs travel as deltas: a request's first and final outputs whole, every other one as the new
  token ids, text and logprobs of each sequence (tokens and text only grow between those); the
  HTTP process rebuilds each cumulative `RequestOutput`. An output that does not extend the
  previous one is sent whole.
- The metrics observer runs in the HTTP process: the child records which observer calls its loop
  made and the HTTP process replays them with the rebuilt outputs.
- `call(fn)` needs a picklable `fn` (a module-level function, `functools.partial`,
  `operator.methodcaller`), run on the engine's thread in the child.
- If the child dies (an exception in a step, or killed), every open stream raises
  `EngineDeadError` and `on_death` is called, as when the in-process loop dies. If the HTTP process
  dies, the child sees its pipe close and exits.
One host only: tensor parallelism over one host's devices works (the child owns them); several
hosts and pooling models keep the in-process engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxengine.async_engine import _ACK, AsyncEngine, OutputObserver, RequestStream, _Abort, _Add, _Call, _Stop
from jaxengine.exceptions import EngineDeadError
from jaxengine.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from jaxengine.config import EngineConfig
    from jaxengine.engine import LLMEngine

logger = logging.getLogger(__name__)

_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(RequestMetrics))


@dataclasses.dataclass
class EngineInfo:
    """What the HTTP process reads of the engine in the child: fixed once the child has started."""

    config: EngineConfig
    model_config: object
    tokenizer: object
    eos_token_ids: object
    initial_stats: dict[str, float]

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(engine.config, engine.model_config, engine.tokenizer, engine.eos_token_ids, dict(engine.stats()))

    def stats(self) -> dict[str, float]:
        return dict(self.initial_stats)


# -- the child process ------------------------------------------------------------------------------
class _Recorder:
    """The child's observer: records the loop's observer calls for the HTTP process to replay. A
    finished output travels with its call (pickled once with its delivery: the same object)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.stepped = False

    def on_step(self, stats: dict[str, float]) -> None:
        self.stepped = True

    def on_output(self, output: RequestOutput, new_tokens: int, first: bool) -> None:
        self.calls.append(("o", output.request_id, new_tokens, first, output if output.finished else None))

    def on_finished(self, output: RequestOutput) -> None:
        self.calls.append(("f", output))


class _Core(AsyncEngine):
    """The engine loop in the child. Streams are the HTTP process's keys (ints)."""

    def __init__(self, engine: LLMEngine, conn) -> None:
        super().__init__(engine, observer=_Recorder())
        self._conn = conn
        self._send_lock = threading.Lock()
        # key -> per sequence (token count, text, logprob count) as last sent
        self._sent: dict[int, list[tuple[int, str, int]]] = {}
        self._posted_stats: dict[str, float] = {}

    def read_commands(self) -> None:
        """The child's reader thread: the HTTP process's messages become the loop's commands."""
        try:
            while True:
                msg = self._conn.recv()
                tag = msg[0]
                if tag == "add":
                    _, key, request_id, prompt, params, arrival, lora = msg
                    if params.structured_outputs is not None:
                        try:  # compiled here (cached), so the loop never waits for a grammar
                            self.engine.compile_grammar(params.structured_outputs)
                        except ValueError as e:
                            self._post([("err", key, e)])
                            continue
                    self._commands.put(_Add(request_id, prompt, params, key, arrival, lora))
                elif tag == "abort":
                    self._commands.put(_Abort(msg[1]))
                elif tag == "call":
                    self._commands.put(_Call(msg[2], _CallReply(self, msg[1])))
                elif tag == "stop":
                    self._commands.put(_Stop())
                    return
        except (EOFError, OSError):  # the HTTP process is gone: stop
            self._commands.put(_Stop())

    def _apply(self, cmd: object, out: list) -> None:
        if isinstance(cmd, _Call):  # what came before the call reaches the HTTP process before its result
            self._stats = dict(self.engine.stats())
            self._send(out[:])
            out.clear()
        super()._apply(cmd, out)  # type: ignore[arg-type]

    def _post(self, items: list) -> None:
        with self._send_lock:
            self._posted_stats = self._stats
            self._conn.send(("step", self._stats, items))

    def reply(self, call_id: int, ok: bool, value: object) -> None:
        try:  # pickled here, once: a result that cannot be is the caller's error, and the loop goes on
            data = pickle.dumps(("call", call_id, ok, value))
        except Exception:  # noqa: BLE001 - whatever pickling raises
            data = pickle.dumps(("call", call_id, False,
                                 TypeError(f"the result of a call cannot be sent between processes: {value!r:.200}")))
        try:
            with self._send_lock:
                self._conn.send_bytes(data)  # `recv` on the other end unpickles it
        except (OSError, ValueError):  # the HTTP process is gone; the reader stops the loop
            pass

    def _send(self, deliveries: list) -> None:
        rec = self.observer
        assert isinstance(rec, _Recorder)
        items = [self._encode(key, item) for key, item in deliveries]
        items.extend(rec.calls)
        if rec.stepped:
            items.append(("s",))
        rec.calls, rec.stepped = [], False
        if items or self._stats != self._posted_stats:  # the stats too: /metrics shows them
            try:
                self._post(items)
            except (OSError, ValueError):  # the HTTP process is gone; the reader stops the loop
                pass

    def _encode(self, key: int, item: object) -> tuple:
        if item is _ACK:
            return ("ack", key)
        if isinstance(item, BaseException):
            self._sent.pop(key, None)
            return ("err", key, item)
        assert isinstance(item, RequestOutput)
        prev = self._sent.get(key)
        if item.finished:
            self._sent.pop(key, None)
            return ("full", key, item)
        seqs = [(len(c.token_ids), c.text, len(c.logprobs) if c.logprobs is not None else 0) for c in item.outputs]
        self._sent[key] = seqs
        if prev is None or len(prev) != len(seqs):
            return ("full", key, item)
        deltas = []
        for c, (ntok, text, nlp) in zip(item.outputs, prev):
            if len(c.token_ids) < ntok or not c.text.startswith(text) or (c.logprobs is not None and len(c.logprobs) < nlp):
                return ("full", key, item)
            deltas.append((c.token_ids[ntok:], c.text[len(text):],
                           c.logprobs[nlp:] if c.logprobs is not None else None,
                           c.cumulative_logprob, c.finish_reason, c.stop_reason))
        m = item.metrics
        metrics = None if m is None else tuple(getattr(m, f) for f in _METRIC_FIELDS)
        return ("delta", key, metrics, item.num_cached_tokens, deltas)


class _CallReply:
    """Stands in for the `concurrent.futures.Future` of a `_Call`: its result goes up the pipe."""

    def __init__(self, core: _Core, call_id: int):
        self._core, self._id = core, call_id

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def set_result(self, value: object) -> None:
        self._core.reply(self._id, True, value)

    def set_exception(self, error: BaseException) -> None:
        self._core.reply(self._id, False, error)

    def done(self) -> bool:
        return False


def _child_main(config: EngineConfig, setup: Callable | None, conn) -> None:
    """The child's entry point: builds the engine, reports ready, runs the loop until stopped."""
    import gc

    # Ctrl+C reaches the whole process group, and a service manager's SIGTERM often does too
    # (systemd's default KillMode): the HTTP process drains its requests and then stops this one; if
    # it dies instead, its end of the pipe closes and this process stops too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from jaxengine.engine import LLMEngine  # (jaxengine's logger is set up on import, as in the parent)

    try:
        engine = LLMEngine(config)
        setup_result = setup(engine) if setup is not None else None
    except BaseException as e:  # noqa: BLE001 - reported to the HTTP process, which raises it
        try:
            conn.send(("failed", e))
        except Exception:  # noqa: BLE001 - an error that does not pickle: its text
            conn.send(("failed", RuntimeError(f"{type(e).__name__}: {e}")))
        conn.close()
        return
    conn.send(("ready", EngineInfo.of(engine), setup_result))
    gc.collect()
    gc.freeze()  # the start-up's objects, out of the collector's view (as the in-process server does)
    core = _Core(engine, conn)
    threading.Thread(target=core.read_commands, name="jaxengine-commands", daemon=True).start()
    core._run()
    if core.error is not None:
        try:
            conn.send(("died", f"{type(core.error).__name__}: {core.error}"))
        except (OSError, ValueError):
            pass
    conn.close()


# -- the HTTP process -------------------------------------------------------------------------------
class _Pipe:
    """`AsyncEngine._commands` of the HTTP process: each command becomes a message to the child."""

    def __init__(self, owner: ProcessAsyncEngine):
        self._owner = owner
        self._lock = threading.Lock()
        self._keys = itertools.count()

    def put(self, cmd: object) -> None:
        o = self._owner
        if isinstance(cmd, _Add):
            key = next(self._keys)
            o._streams[key] = cmd.stream
            msg: tuple = ("add", key, cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time, cmd.lora_request)
        elif isinstance(cmd, _Abort):
            msg = ("abort", cmd.request_id)
        elif isinstance(cmd, _Call):
            key = next(self._keys)
            o._calls[key] = cmd.future
            msg = ("call", key, cmd.fn)
        elif isinstance(cmd, _Stop):
            msg = ("stop",)
        else:
            raise TypeError(f"unknown command {cmd!r}")
        try:
            with self._lock:
                o._conn.send(msg)
        except (OSError, ValueError) as e:  # the child is gone; the reader reports it
            if isinstance(cmd, _Call) and not cmd.future.done():
                cmd.future.set_exception(EngineDeadError(f"the engine process is gone: {e}"))


class ProcessAsyncEngine(AsyncEngine):
    """An `AsyncEngine` whose `LLMEngine` runs in a child process (see the module docstring).
    Build it with `launch`, which returns once the engine in the child has started."""

    STOP_TIMEOUT_S = 60.0  # shutdown: how long the child may take to exit once told to stop

    def __init__(self, info: EngineInfo, conn, process, *, setup_result: object = None,
                 observer: OutputObserver | None = None, on_death: Callable[[BaseException], None] | None = None):
        super().__init__(info, observer=observer, on_death=on_death)  # type: ignore[arg-type]
        self.setup_result = setup_result
        self.process = process
        self._conn = conn
        self._commands = _Pipe(self)  # type: ignore[assignment]
        self._streams: dict[int, RequestStream] = {}  # key -> stream; written by the loop, read by the reader
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._outputs: dict[int, RequestOutput] = {}  # reader only: each request's newest rebuilt output
        self._stopping = False

    @classmethod
    def launch(cls, config: EngineConfig, *, setup: Callable[[LLMEngine], object] | None = None,
               timeout: float | None = None) -> ProcessAsyncEngine:
        """Starts the child, builds the engine there (and runs the picklable `setup(engine)`, e.g.
        loading start-up adapters; its result is `setup_result`), and returns once it is ready.
        An error while starting is raised here (a `ValueError` stays one)."""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        process = ctx.Process(target=_child_main, name="jaxengine-engine", daemon=True,
                              args=(config, setup, child))
        process.start()
        child.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not parent.poll(0.5):
                if not process.is_alive():
                    raise RuntimeError(f"the engine process exited while starting (exit code {process.exitcode})")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the engine process did not start within {timeout} s")
            msg = parent.recv()
        except BaseException:
            process.terminate()
            process.join(10)
            raise
        if msg[0] == "failed":
            process.join(10)
            raise msg[1]
        _, info, setup_result = msg
        logger.info("engine process %d ready", process.pid)
        return cls(info, parent, process, setup_result=setup_result)

    # -- lifecycle ------------------------------------------------------------------------------
    _thread_name = "jaxengine-outputs"  # `start` runs the reader of the child's messages

    def _thread_main(self) -> None:
        self._read()

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        self._stopping = True
        if self._thread is None:  # never started: only the child to stop
            self._commands.put(_Stop())
        else:
            await super().shutdown(drain_timeout)
        if not await asyncio.to_thread(self._reap, self.STOP_TIMEOUT_S):
            logger.warning("the engine process did not stop within %.0f s; killing it", self.STOP_TIMEOUT_S)
            self.process.kill()  # it ignores SIGTERM (see _child_main)
            await asyncio.to_thread(self.process.join, 10.0)
        self._conn.close()

    def _reap(self, timeout: float) -> bool:
        """Waits up to `timeout` s for the child to have exited; whether it has. Polled, not joined:
        the child's end of its sentinel pipe closes early in its exit, while the rest of the exit (a
        GPU's memory handed back to the driver) can take seconds more."""
        deadline = time.monotonic() + timeout
        while self.process.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    # -- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        died: str | None = None
        try:
            while True:
                msg = self._conn.recv()
                tag = msg[0]
                if tag == "step":
                    self._stats = msg[1]
                    self._on_items(msg[2])
                elif tag == "call":
                    future = self._calls.pop(msg[1], None)
                    if future is not None and not future.done():
                        (future.set_result if msg[2] else future.set_exception)(msg[3])
                elif tag == "died":
                    died = msg[1]
        except (EOFError, OSError):
            pass
        except BaseException as e:  # noqa: BLE001 - a message this process could not handle
            logger.exception("reading the engine process's outputs failed")
            died = f"{type(e).__name__}: {e}"
        if died is None and self._stopping:
            return
        self._reap(10.0)
        reason = died or f"the engine process exited (exit code {self.process.exitcode})"
        self._die(EngineDeadError(f"the engine loop died: {reason}"))

    def _die(self, error: BaseException) -> None:
        self._error = error
        logger.error("%s", error)
        deliveries = [(stream, error) for stream in self._streams.values()]
        self._streams.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        self._send(deliveries)
        if self.on_death is not None:
            try:
                self.on_death(error)
            except Exception:  # noqa: BLE001
                logger.exception("on_death callback failed")

    def _on_items(self, items: list) -> None:
        deliveries: list[tuple[RequestStream, object]] = []
        observer = self.observer
        outputs = self._outputs
        seen: dict[str, RequestOutput] = {}
        for item in items:
            tag = item[0]
            if tag == "delta":
                key = item[1]
                out = outputs[key] = _apply_delta(outputs[key], item)
            elif tag == "full":
                key, out = item[1], item[2]
                if out.finished:
                    outputs.pop(key, None)
                else:
                    outputs[key] = out
            elif tag == "ack":
                stream = self._streams.get(item[1])
                if stream is not None:
                    deliveries.append((stream, _ACK))
                continue
            elif tag == "err":
                outputs.pop(item[1], None)
                stream = self._streams.pop(item[1], None)
                if stream is not None:
                    deliveries.append((stream, item[2]))
                continue
            elif observer is not None:  # the child loop's observer calls, in order
                if tag == "o":
                    out = item[4] or seen.get(item[1])
                    if out is not None:
                        observer.on_output(out, item[2], item[3])
                elif tag == "f":
                    observer.on_finished(item[1])
                elif tag == "s":
                    observer.on_step(self._stats)
                continue
            else:
                continue
            seen[out.request_id] = out
            stream = self._streams.pop(key, None) if out.finished else self._streams.get(key)
            if stream is not None:
                deliveries.append((stream, out))
        self._send(deliveries)


def _apply_delta(prev: RequestOutput, item: tuple) -> RequestOutput:
    """The next cumulative output: `prev` extended by the delta `item` (see `_Core._encode`)."""
    _, _, metrics, num_cached, deltas = item
    seqs = [CompletionOutput(index=p.index, text=p.text + text, token_ids=p.token_ids + tokens,
                             cumulative_logprob=cum,
                             logprobs=p.logprobs + logprobs if logprobs is not None and p.logprobs is not None else p.logprobs,
                             finish_reason=finish, stop_reason=stop)
            for p, (tokens, text, logprobs, cum, finish, stop) in zip(prev.outputs, deltas)]
    return RequestOutput(request_id=prev.request_id, prompt=prev.prompt, prompt_token_ids=prev.prompt_token_ids,
                         prompt_logprobs=prev.prompt_logprobs, outputs=seqs, finished=False,
                         metrics=None if metrics is None else RequestMetrics(*metrics), num_cached_tokens=num_cached)


__all__ = ["ProcessAsyncEngine", "EngineInfo"]
