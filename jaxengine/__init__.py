"""jaxengine: an LLM inference and serving engine on JAX/XLA with vLLM's API."""

from __future__ import annotations

import logging
import os
import sys

__version__ = "0.1.0"

# In a source checkout the other installed packages live beside this folder (pyproject's
# package-dir maps models/ to jaxengine.models, server/ to jaxengine.server, ...). Run from the
# checkout's root, this folder shadows any installed jaxengine, so its subpackages must be found
# from here too: the checkout's root joins this package's search path.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "pyproject.toml")) and os.path.isfile(
        os.path.join(_checkout, "models", "__init__.py")):
    __path__.append(_checkout)

class _StderrHandler(logging.StreamHandler):
    """Writes to the current sys.stderr, looked up per record: binding the stream at import time
    breaks when the importer had swapped stderr (test capture, daemons) and later closes it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


# transformers (tokenizers, configs, chat templates) warns at import that PyTorch is missing;
# jaxengine never uses PyTorch, so the advice is noise here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

_level = os.environ.get("JAXENGINE_LOGGING_LEVEL", "INFO").upper()
_logger = logging.getLogger("jaxengine")
if not _logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    _logger.addHandler(_handler)
    _logger.propagate = False
_logger.setLevel(_level)

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "TextPrompt", "TokensPrompt", "StructuredOutputsParams", "GuidedDecodingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import jaxengine.models` (and the pure-Python scheduler) stay light.
    if name == "LLM":
        from jaxengine.llm import LLM
        return LLM
    if name in ("SamplingParams", "BeamSearchParams"):
        from jaxengine import sampling_params
        return getattr(sampling_params, name)
    if name in ("StructuredOutputsParams", "GuidedDecodingParams"):
        from jaxengine import structured_outputs
        return getattr(structured_outputs, name)
    if name == "PoolingParams":
        from jaxengine.pooling_params import PoolingParams
        return PoolingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from jaxengine import outputs
        return getattr(outputs, name)
    if name in ("TextPrompt", "TokensPrompt"):
        from jaxengine import inputs
        return getattr(inputs, name)
    raise AttributeError(f"module 'jaxengine' has no attribute {name!r}")
