"""Counts XLA compilations (through `jax.monitoring`), so a compile after warm-up can be seen.

Every program the engine runs is compiled at start-up; a later compile means a shape escaped the
buckets (or stray device work on the host path) and is logged as a warning by the engine.
"""

from __future__ import annotations

import threading

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class _Counter:
    def __init__(self) -> None:
        self.compiles = 0  # programs lowered to an executable (backend compile or persistent-cache hit)
        self.backend_compiles = 0
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        with self._lock:
            if self._installed:
                return
            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            jax.monitoring.register_event_listener(self._on_event)
            self._installed = True

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == _BACKEND_COMPILE:
            with self._lock:
                self.compiles += 1
                self.backend_compiles += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT:
            with self._lock:
                self.compiles += 1


COMPILES = _Counter()


def compile_count() -> int:
    """Executables produced so far in this process (compiled, or loaded from the persistent cache)."""
    COMPILES.install()
    return COMPILES.compiles
