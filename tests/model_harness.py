"""Runs a loaded model through the paged path without the scheduler (for model-level tests)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.attention_backend import AttentionBackend, select_attention_backend
from jaxengine.input_batch import InputBuilder


class PagedRunner:
    """Owns a KV cache and hands each sequence its own (shuffled) blocks. `attention`: the
    attention backend the model runs (default: the jnp reference)."""

    def __init__(self, graphdef, state, cfg, *, block_size: int = 16, num_blocks: int = 64,
                 max_len: int = 256, seed: int = 0, attention: AttentionBackend | None = None):
        self.model = nnx.merge(graphdef, state)
        self.cfg, self.bs = cfg, block_size
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        dtype = self.model.model.embed_tokens[...].dtype
        attention = attention or select_attention_backend("reference", cfg, dtype, block_size)
        kv_dtype = attention.kv_dtype(dtype)
        self.kv = [(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype)) for _ in range(cfg.num_layers)]
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
        self.blocks: dict[int, list[int]] = {}
        self.m = -(-max_len // block_size)
        self.builder = InputBuilder(self.m, block_size)

        def fwd(state, kv, inputs):
            model = nnx.merge(graphdef, state)
            hidden, kv = model(inputs.input_ids, inputs.positions, kv, inputs.attn, attention)
            return kv, model.compute_logits(hidden)

        self.state = state
        self._fwd = jax.jit(fwd)

    def step(self, chunks: list[tuple[int, list[int], int]], t: int | None = None) -> list[np.ndarray]:
        """chunks: (seq id, all token ids of the sequence so far, start). Returns logits per chunk row."""
        seqs = []
        for sid, toks, start in chunks:
            blocks = self.blocks.setdefault(sid, [])
            while len(blocks) * self.bs < len(toks):
                blocks.append(int(self.free.pop()))
            req = types.SimpleNamespace(all_token_ids=toks, token_ids_slice=lambda a, b, toks=toks: toks[a:b])
            seqs.append(types.SimpleNamespace(request=req, request_id=str(sid), token_ids=toks[start:],
                                              start=start, num_new_tokens=len(toks) - start,
                                              block_ids=list(blocks)))
        n = sum(s.num_new_tokens for s in seqs)
        t = t or max(16, 1 << (n - 1).bit_length())
        inputs = self.builder.build(seqs, t, max(len(seqs), 1))
        self.kv, logits = self._fwd(self.state, self.kv, inputs)
        logits = np.asarray(logits)
        out, cur = [], 0
        for s in seqs:
            out.append(logits[cur:cur + s.num_new_tokens])
            cur += s.num_new_tokens
        return out
