"""The Mosaic GPU prefill kernel on the CPU: what can be checked without a Hopper GPU.

- The tile layout (built by XLA around the kernel): every prefill row is computed by exactly one
  tile row and gathered back to its place; tiles are ordered heaviest first. The kernel is
  emulated by filling each tile row with the reference output of the token and head the kernel
  gives that row, the rest poisoned with NaN.
- The kernel lowers for CUDA (Mosaic GPU's layout and TMA checks run at lowering).
- Options are validated with clear errors.
The kernel body itself runs on the H100 (benchmarks/kernels/bench_paged_attention.py --mosaic:
correctness cases and timings in benchmarks/results/kernels_h100_mosaic*.json); Pallas' Mosaic
GPU interpreter does not run it (no run_state support).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.config import EngineConfig
from jaxengine.pallas_kernels import ragged_paged_attention_mgpu as mgpu
from jaxengine.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention, ragged_paged_attention_reference)
from jaxengine.pallas_kernels.ragged_paged_attention_gpu import (
    _row_kinds, ragged_paged_attention_gpu)
from tests.kernels.batch_factory import make_batch


def _emulate_tiles(layout, ref: np.ndarray, *, k: int, g: int) -> np.ndarray:
    """What the kernel writes: tile row r of warpgroup w of CTA c = token t0 + w*TQ + r % TQ,
    head kh * G + r // TQ, for live tokens of the tile's sequence; NaN elsewhere."""
    t, n, h = ref.shape
    tq = 64 // g
    table = np.asarray(layout.table)
    nt = table.shape[0]
    out = np.full((k, nt, 2, 64, h), np.nan, np.float32)
    for c in range(nt):
        seq, t0, q_end = table[c, :3]
        if seq < 0:
            continue
        for w in range(2):
            for r in range(64):
                tok = t0 + w * tq + r % tq
                if tok < q_end:
                    for kh in range(k):
                        out[kh, c, w, r] = ref[tok, kh * g + r // tq]
    return out


@pytest.mark.parametrize("n,k,q_lens,ctx_lens,pad_slots,pad_tokens", [
    (32, 8, [1, 1, 37, 300, 17, 64, 2], [15, 3000, 0, 500, 1234, 63, 1], 2, 2),
    (16, 2, [1, 129, 8, 250], [40, 0, 31, 777], 0, 4),
    (4, 4, [3, 200, 1, 100], [0, 64, 10, 129], 1, 0),
    (8, 8, [1, 1, 1], [5, 6, 7], 0, 5),  # decode only: no tile has work
])
def test_tile_layout_routes_every_prefill_row(n, k, q_lens, ctx_lens, pad_slots, pad_tokens):
    rng = np.random.default_rng(len(q_lens) + n)
    b = make_batch(rng, q_lens=q_lens, ctx_lens=ctx_lens, num_heads=n, num_kv_heads=k,
                   head_dim=16, block_size=16, dtype=jnp.float32, pad_slots=pad_slots,
                   pad_tokens=pad_tokens)
    t, s = b.q.shape[0], b.block_tables.shape[0]
    layout = mgpu.tile_layout(b.query_start_loc, b.kv_lens, b.num_seqs, t=t, s=s, n=n, k=k)
    ref = np.asarray(ragged_paged_attention_reference(*b.args(), sm_scale=0.25))
    tiles = _emulate_tiles(layout, ref, k=k, g=n // k)
    got = tiles.reshape(-1, ref.shape[-1])[np.asarray(layout.flat)]
    kinds = np.asarray(_row_kinds(b.query_start_loc, b.kv_lens, b.num_seqs, t))
    expect_kinds = np.concatenate([np.where(np.asarray(q_lens) == 1, 1, 2).repeat(q_lens),
                                   np.zeros(pad_tokens, int)])
    np.testing.assert_array_equal(kinds, expect_kinds)
    pre = kinds == 2
    np.testing.assert_array_equal(got[pre], ref[pre])  # exact: a pure data movement
    table = np.asarray(layout.table)
    live = table[:, 0] >= 0
    assert live.sum() == sum(-(-q // (2 * 64 // (n // k))) for q in q_lens if q > 1)
    assert (np.diff(table[live, 3]) <= 0).all()  # heaviest (furthest-reaching) tiles first
    assert not live[live.sum():].any()


@pytest.mark.parametrize("n,k,h,p", [(32, 8, 128, 16), (16, 2, 64, 32)])
def test_mosaic_prefill_lowers_for_cuda(n, k, h, p):
    t, s, m, blocks = 64, 4, 16, 64
    sd = jax.ShapeDtypeStruct
    args = (sd((t, n, h), jnp.bfloat16), sd((blocks, k, p, h), jnp.bfloat16),
            sd((blocks, k, p, h), jnp.bfloat16), sd((s,), jnp.int32), sd((s, m), jnp.int32),
            sd((s + 1,), jnp.int32), sd((1,), jnp.int32))
    lowered = ragged_paged_attention_gpu.trace(*args, sm_scale=h ** -0.5, prefill="mosaic").lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text and "rpa_decode" in text


def test_prefill_option_errors():
    rng = np.random.default_rng(0)
    b = make_batch(rng, q_lens=[1, 9], ctx_lens=[3, 4], num_heads=8, num_kv_heads=2,
                   head_dim=64, block_size=16, dtype=jnp.bfloat16, pad_tokens=6)
    with pytest.raises(ValueError, match="prefill must be 'triton', 'mosaic' or 'auto'"):
        ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, prefill="cuda")
    with pytest.raises(ValueError, match="prefill='mosaic' cannot serve this call"):
        ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, soft_cap=30.0, prefill="mosaic")
    with pytest.raises(ValueError, match="prefill='mosaic' cannot serve this call"):
        ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, prefill="mosaic", interpret=True)
    with pytest.raises(ValueError, match="block_kv must be a multiple of 64"):
        mgpu.MosaicTiling(block_kv=96)
    assert EngineConfig(attention_backend="pallas-mosaic").attention_backend == "pallas-mosaic"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="mosaic")


def test_pallas_mosaic_backend_off_gpu_is_the_reference():
    rng = np.random.default_rng(1)
    b = make_batch(rng, q_lens=[1, 20], ctx_lens=[7, 30], num_heads=4, num_kv_heads=2,
                   head_dim=16, block_size=16, dtype=jnp.float32)
    got = ragged_paged_attention(*b.args(), sm_scale=0.25, backend="pallas-mosaic")
    ref = ragged_paged_attention_reference(*b.args(), sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)
