"""The CPU paged-attention path (batched matmuls over tiles of one sequence's rows) against a
float64 dense attention per sequence and against the jnp reference, over the same ragged batches
as the GPU kernel's tests, with every tiling (rows per tile, tiles per group, blocks per loop
step) exercised, groups that hold tiles of different sequences and lengths included.

Each jitted function is made once per set of static arguments, and the cases that share a
function use the same shapes where the case allows it (the one-sequence lengths are padded to
one token count and one block pool), so a case compiles only when its static arguments or
shapes are new: most of this file's time is XLA compiling."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention_cpu, ragged_paged_attention_reference)
from tests.kernels.batch_factory import Batch, dense_reference, make_batch


def _rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


@functools.lru_cache(maxsize=None)
def _cpu_fn(**static):
    """ragged_paged_attention_cpu jitted for these static arguments (one per set, so cases with
    the same arguments and shapes share the compiled program)."""
    return jax.jit(functools.partial(ragged_paged_attention_cpu, **static))


@functools.lru_cache(maxsize=None)
def _reference_fn(**static):
    return jax.jit(functools.partial(ragged_paged_attention_reference, **static))


def _check(b: Batch, *, sm_scale: float, soft_cap: float | None = None,
           sliding_window: int | None = None, **tiling) -> np.ndarray:
    fn = _cpu_fn(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, **tiling)
    out = np.asarray(fn(*b.args()).astype(jnp.float32), np.float64)
    assert out.shape == b.q.shape
    assert np.isfinite(out).all()
    dense = dense_reference(b, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    tol = 1e-5 if b.q.dtype == jnp.float32 else 2e-2
    assert _rel_err(out, dense) < tol
    ref = _reference_fn(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)(*b.args())
    assert _rel_err(out, np.asarray(ref.astype(jnp.float32), np.float64)) < tol
    live_end = int(np.asarray(b.query_start_loc)[int(b.num_seqs[0])])
    assert (out[live_end:] == 0).all(), "padding token rows must be zeros"
    return out


# (block size, query heads, KV heads, head dim, dtype)
_GRID = [
    (16, 8, 2, 64, jnp.float32),
    (16, 32, 8, 128, jnp.bfloat16),
    (32, 8, 8, 64, jnp.bfloat16),
    (64, 4, 4, 128, jnp.float32),
    (16, 9, 3, 64, jnp.float32),  # SmolLM2's heads
]


@pytest.mark.parametrize("block,n,k,h,dtype", _GRID)
@pytest.mark.parametrize("tile_rows,group,chunk_blocks", [(None, None, 2), (1, 1, 1), (1, 8, 3), (4, 3, 3),
                                                         (16, 4, 2)])
def test_mixed_batch_matches_dense(block, n, k, h, dtype, tile_rows, group, chunk_blocks):
    """Decodes with lengths 1, P-1, P, P+1 and long, then prefill chunks with and without context."""
    rng = np.random.default_rng(block * 1000 + n * 10 + k + h)
    p = block
    b = make_batch(rng, q_lens=[1, 1, 1, 1, 1, 3, 2 * p + 5, p + 1],
                   ctx_lens=[0, p - 2, p - 1, p, 3 * p + 7, 0, 0, 2 * p - 3],
                   num_heads=n, num_kv_heads=k, head_dim=h, block_size=p, dtype=dtype,
                   pad_slots=2, pad_tokens=5)
    # eight live sequences: the tiled path (the dispatch between the paths is checked below)
    _check(b, sm_scale=h ** -0.5, tile_rows=tile_rows, group=group, chunk_blocks=chunk_blocks,
           single_chunk_blocks=None)


@pytest.mark.parametrize("soft_cap,window", [(None, 5), (20.0, None), (10.0, 37)])
@pytest.mark.parametrize("tile_rows", [1, 8])
def test_soft_cap_and_sliding_window(soft_cap, window, tile_rows):
    rng = np.random.default_rng(7 + (window or 0))
    b = make_batch(rng, q_lens=[1, 1, 40, 7], ctx_lens=[70, 3, 10, 50], num_heads=8,
                   num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float32, pad_slots=1)
    _check(b, sm_scale=1.0 if soft_cap else 0.125, soft_cap=soft_cap, sliding_window=window,
           tile_rows=tile_rows)


def test_large_bucket_prefill_and_decode_mix():
    """A 256-token bucket: tiles of several rows, chunks cut mid-tile, the table padded to a
    multiple of the blocks per step (M = 13 is not a multiple of 2 or 4)."""
    rng = np.random.default_rng(31)
    b = make_batch(rng, q_lens=[1, 1, 1, 100, 37, 90], ctx_lens=[150, 9, 0, 0, 60, 17],
                   num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=jnp.float32,
                   pad_slots=2, pad_tokens=256 - 230, max_blocks=13)
    for chunk_blocks, group in ((1, None), (2, 5), (4, 64)):  # six live sequences: the tiled path
        _check(b, sm_scale=0.125, chunk_blocks=chunk_blocks, group=group, single_chunk_blocks=None)


def test_every_tile_bound_is_enough():
    """Worst case for the static tile count: as many sequences as possible, each one row past a
    tile boundary."""
    rng = np.random.default_rng(4)
    q_lens = [5] * 12 + [1] * 4
    b = make_batch(rng, q_lens=q_lens, ctx_lens=[3] * 16, num_heads=4, num_kv_heads=2,
                   head_dim=64, block_size=16, dtype=jnp.float32)
    _check(b, sm_scale=0.125, tile_rows=4)


def test_no_live_sequences_gives_zeros():
    rng = np.random.default_rng(3)
    b = make_batch(rng, q_lens=[4], ctx_lens=[3], num_heads=4, num_kv_heads=2, head_dim=64,
                   block_size=16, dtype=jnp.float32, pad_slots=2)
    b = Batch(*b.args()[:6], num_seqs=jnp.zeros((1,), jnp.int32))
    out = ragged_paged_attention_cpu(*b.args(), sm_scale=0.1)
    assert (np.asarray(out) == 0).all()


def test_padded_slots_ignore_garbage_tables():
    rng = np.random.default_rng(5)
    b = make_batch(rng, q_lens=[1, 6], ctx_lens=[20, 4], num_heads=4, num_kv_heads=1,
                   head_dim=64, block_size=16, dtype=jnp.float32, pad_slots=3, pad_tokens=4)
    bt = np.asarray(b.block_tables).copy()
    bt[2:] = rng.integers(0, b.k_cache.shape[0], bt[2:].shape)
    kvl = np.asarray(b.kv_lens).copy()
    kvl[2:] = 17
    b2 = Batch(b.q, b.k_cache, b.v_cache, jnp.asarray(kvl), jnp.asarray(bt),
               b.query_start_loc, b.num_seqs)
    out1 = ragged_paged_attention_cpu(*b.args(), sm_scale=0.1)
    out2 = ragged_paged_attention_cpu(*b2.args(), sm_scale=0.1)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))


def _one_sequence_batch(rng, q_len: int, ctx: int, *, num_tokens: int, pool: int, max_blocks: int,
                        **kw) -> Batch:
    """One live sequence in a batch of fixed shapes: `num_tokens` token rows (the rest padding),
    a pool of `pool` cache blocks, a table of `max_blocks`, so every length shares one program."""
    need = -(-(q_len + ctx) // 16)
    assert q_len < num_tokens and need + 1 < pool and need <= max_blocks
    return make_batch(rng, q_lens=[q_len], ctx_lens=[ctx], head_dim=64, block_size=16, dtype=jnp.float32,
                      pad_tokens=num_tokens - q_len, extra_blocks=pool - 1 - need, max_blocks=max_blocks, **kw)


@pytest.mark.parametrize("q_len,ctx", [(1, 0), (1, 15), (1, 16), (1, 17), (1, 300), (16, 0), (40, 70), (100, 17), (64, 200)])
@pytest.mark.parametrize("single_chunk_blocks", [1, 3, 16])
def test_one_sequence_path_matches_dense(q_len, ctx, single_chunk_blocks):
    """A step of one live sequence (batch-1 decode, a prompt's chunk) runs the one-tile path:
    lengths 1, P-1, P, P+1 and long, chunks with and without context, padded slots and tokens,
    the table padded to a multiple of the blocks per step (M = 25)."""
    rng = np.random.default_rng(q_len * 1000 + ctx + single_chunk_blocks)
    b = _one_sequence_batch(rng, q_len, ctx, num_tokens=105, pool=23, num_heads=9, num_kv_heads=3,
                            pad_slots=2, max_blocks=25)
    out = _check(b, sm_scale=0.125, single_chunk_blocks=single_chunk_blocks)
    tiled = _cpu_fn(sm_scale=0.125, single_chunk_blocks=None)(*b.args())
    np.testing.assert_allclose(out, np.asarray(tiled, np.float64), rtol=1e-5, atol=1e-6)


def test_one_sequence_long_tile_takes_long_steps():
    """A program of at least 128 token rows (a prompt's chunk) takes `long_chunk_blocks` keys a
    step: here a 120-token chunk after 700 tokens of context, with 2 blocks a step (21 unmasked
    steps before the chunk's first token, then the diagonal's masked ones) and with 64 (a single
    masked step over a table padded past its end)."""
    rng = np.random.default_rng(7)
    b = _one_sequence_batch(rng, 120, 700, num_tokens=128, pool=56, num_heads=9, num_kv_heads=3,
                            pad_slots=1, max_blocks=54)
    for long_chunk_blocks in (2, 64):
        _check(b, sm_scale=0.125, single_chunk_blocks=1, long_chunk_blocks=long_chunk_blocks)


@pytest.mark.parametrize("soft_cap,window", [(None, 5), (20.0, None), (10.0, 37)])
@pytest.mark.parametrize("q_len,ctx", [(1, 90), (40, 70)])
def test_one_sequence_soft_cap_and_sliding_window(soft_cap, window, q_len, ctx):
    rng = np.random.default_rng(11 + (window or 0) + q_len)
    b = _one_sequence_batch(rng, q_len, ctx, num_tokens=43, pool=12, num_heads=8, num_kv_heads=2,
                            pad_slots=1, max_blocks=7)
    _check(b, sm_scale=1.0 if soft_cap else 0.125, soft_cap=soft_cap, sliding_window=window,
           single_chunk_blocks=2)
