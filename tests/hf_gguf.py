"""transformers' GGUF loading path, made cheaper for the tests without changing what it loads."""

from __future__ import annotations

import contextlib
import functools

import gguf
import pytest


@contextlib.contextmanager
def cached_gguf_name_map():
    """transformers' `get_gguf_hf_weights_map` rebuilds gguf-py's tensor-name table for every
    module it walks (about 400 times for SmolLM2, several seconds on 2 cores). The table depends
    only on (arch, n_blocks) and is only read, so inside this block each is built once; the
    tensors, names and config that transformers produces are the same."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        yield
