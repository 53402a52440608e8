"""Random ragged paged-attention batches and a float64 dense reference (numpy).

Each batch lists decode rows first, then prefill chunks, then padded slots; blocks are handed
out in a random permutation of the pool (block 0 stays the null block), so the kernel must go
through the block table.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Batch:
    q: jnp.ndarray             # [T, N, H]
    k_cache: jnp.ndarray       # [B, K, P, H]
    v_cache: jnp.ndarray       # [B, K, P, H]
    kv_lens: jnp.ndarray       # [S] int32
    block_tables: jnp.ndarray  # [S, M] int32
    query_start_loc: jnp.ndarray  # [S + 1] int32
    num_seqs: jnp.ndarray      # [1] int32

    def args(self) -> tuple[jnp.ndarray, ...]:
        return (self.q, self.k_cache, self.v_cache, self.kv_lens, self.block_tables,
                self.query_start_loc, self.num_seqs)


def make_batch(rng: np.random.Generator, *, q_lens: list[int], ctx_lens: list[int],
               num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype=jnp.bfloat16, pad_slots: int = 0, pad_tokens: int = 0,
               extra_blocks: int = 3, max_blocks: int | None = None,
               key_growth: float = 0.0) -> Batch:
    """q_lens[i] new tokens after ctx_lens[i] cached ones for each live sequence. key_growth:
    each sequence's key at position j is scaled by 1 + key_growth * j, so that later keys
    score ever higher (a running max that keeps rising, far past the earlier keys' scores)."""
    assert len(q_lens) == len(ctx_lens)
    kv = [c + q for c, q in zip(ctx_lens, q_lens)]
    need = [-(-x // block_size) for x in kv]
    m = max_blocks or max(max(need), 1)
    n_blocks = 1 + sum(need) + extra_blocks
    perm = rng.permutation(np.arange(1, n_blocks)).astype(np.int32)
    s = len(q_lens) + pad_slots
    tables = np.zeros((s, m), np.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    t = sum(q_lens) + pad_tokens
    qsl = np.zeros(s + 1, np.int32)
    qsl[1:len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1:] = qsl[len(q_lens)]
    kv_lens = np.zeros(s, np.int32)
    kv_lens[:len(kv)] = kv
    shape = (n_blocks, num_kv_heads, block_size, head_dim)
    q = rng.standard_normal((t, num_heads, head_dim))
    k = rng.standard_normal(shape)
    if key_growth:
        pos = np.arange(block_size)
        for i, nb in enumerate(need):
            for j in range(nb):
                k[tables[i, j]] *= (1 + key_growth * (j * block_size + pos))[None, :, None]
    return Batch(
        q=jnp.asarray(q, dtype),
        k_cache=jnp.asarray(k, dtype),
        v_cache=jnp.asarray(rng.standard_normal(shape), dtype),
        kv_lens=jnp.asarray(kv_lens), block_tables=jnp.asarray(tables),
        query_start_loc=jnp.asarray(qsl), num_seqs=jnp.asarray([len(q_lens)], jnp.int32))


def dense_reference(b: Batch, *, sm_scale: float, soft_cap: float | None = None,
                    sliding_window: int | None = None) -> np.ndarray:
    """Per-sequence dense causal attention in float64 over the gathered cache."""
    q = np.asarray(b.q, np.float64)
    kc = np.asarray(b.k_cache, np.float64)
    vc = np.asarray(b.v_cache, np.float64)
    qsl = np.asarray(b.query_start_loc)
    kvl = np.asarray(b.kv_lens)
    tables = np.asarray(b.block_tables)
    t, n, h = q.shape
    k_heads, p = kc.shape[1], kc.shape[2]
    g = n // k_heads
    out = np.zeros((t, n, h))
    for s in range(int(np.asarray(b.num_seqs)[0])):
        lo, hi, kv_len = qsl[s], qsl[s + 1], kvl[s]
        if hi == lo:
            continue
        blocks = tables[s, :-(-kv_len // p)]
        keys = kc[blocks].transpose(1, 0, 2, 3).reshape(k_heads, -1, h)[:, :kv_len]
        vals = vc[blocks].transpose(1, 0, 2, 3).reshape(k_heads, -1, h)[:, :kv_len]
        keys = np.repeat(keys, g, axis=0)  # [N, kv, H]
        vals = np.repeat(vals, g, axis=0)
        qpos = kv_len - (hi - lo) + np.arange(hi - lo)
        kpos = np.arange(kv_len)
        logits = np.matmul(q[lo:hi].transpose(1, 0, 2), keys.transpose(0, 2, 1)) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        allowed = kpos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            allowed &= kpos[None, :] > qpos[:, None] - sliding_window
        logits = np.where(allowed[None], logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[lo:hi] = np.matmul(w, vals).transpose(1, 0, 2)  # [N, t, H] -> [t, N, H]
    return out
