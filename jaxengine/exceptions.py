"""What the engine raises to its callers beyond `ValueError` (bad input)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop thread stopped (crashed or shut down): no request can be served."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its output processing raised); the engine and every
    other request go on. The server answers it with a 500 (or an error event in a stream that
    has started)."""
