"""Counts JAX traces and XLA compilations (through `jax.monitoring`), so a compile after warm-up
can be seen and start-up can say where its time went.

A compile after warm-up means a shape escaped the buckets (or stray device work on the host
path) and is logged as a warning by the engine. `snapshot()` feeds the start-up breakdown
(jaxengine.startup): traces, lowerings and backend compiles with their summed durations.
"""

from __future__ import annotations

import dataclasses
import threading

import jax

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # also spans a persistent-cache read
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """Counts since the process started; durations are summed over threads (compiles run in parallel)."""

    traces: int = 0  # Python functions traced to a jaxpr
    trace_s: float = 0.0
    lower_s: float = 0.0  # jaxpr -> StableHLO
    backend_compiles: int = 0  # executables produced by XLA or read from the persistent cache
    backend_s: float = 0.0
    cache_hits: int = 0  # of backend_compiles, those read from the persistent compilation cache

    def __sub__(self, other: CompileStats) -> CompileStats:
        return CompileStats(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)))

    @property
    def xla_compiles(self) -> int:
        """Executables XLA compiled (persistent-cache reads excluded)."""
        return self.backend_compiles - self.cache_hits


class _Counter:
    def __init__(self) -> None:
        self.compiles = 0  # programs lowered to an executable (backend compile or persistent-cache hit)
        self.backend_compiles = 0
        self.traces = 0
        self.cache_hits = 0
        self.seconds = {_TRACE: 0.0, _LOWER: 0.0, _BACKEND_COMPILE: 0.0}
        self._lock = threading.Lock()
        self._installed = False
        self._local = threading.local()  # this thread's persistent-cache hits (thread_cache_hits)

    def install(self) -> None:
        with self._lock:
            if self._installed:
                return
            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            jax.monitoring.register_event_listener(self._on_event)
            self._installed = True

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event not in self.seconds:
            return
        with self._lock:
            self.seconds[event] += duration
            if event == _BACKEND_COMPILE:
                self.compiles += 1
                self.backend_compiles += 1
            elif event == _TRACE:
                self.traces += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT:
            self._local.hits = getattr(self._local, "hits", 0) + 1  # JAX records it in the compiling thread
            with self._lock:
                self.compiles += 1
                self.cache_hits += 1


COMPILES = _Counter()


def compile_count() -> int:
    """Executables produced so far in this process (compiled, or loaded from the persistent cache)."""
    COMPILES.install()
    return COMPILES.compiles


def snapshot() -> CompileStats:
    """Traces and compiles so far in this process (counting starts at the first call)."""
    COMPILES.install()
    c = COMPILES
    with c._lock:
        return CompileStats(c.traces, c.seconds[_TRACE], c.seconds[_LOWER], c.backend_compiles,
                            c.seconds[_BACKEND_COMPILE], c.cache_hits)


def thread_cache_hits() -> int:
    """Executables the calling thread has read from JAX's persistent compilation cache (counting
    starts at the first call of any function here): a compile that raised it was a cache read."""
    COMPILES.install()
    return getattr(COMPILES._local, "hits", 0)
