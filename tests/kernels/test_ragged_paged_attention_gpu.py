"""The Pallas GPU ragged paged-attention kernels, run through Pallas' interpreter on the CPU.

Checked against a float64 dense attention per sequence and against the jnp reference. Inputs
are fresh random draws per case; blocks come from a random permutation of the pool. Outputs
the kernels do not write stay NaN in interpret mode (Pallas initialises them so), so a missed
row fails the NaN check below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.pallas_kernels import gpu_backend
from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from jaxengine.pallas_kernels.ragged_paged_attention_gpu import Tiling, ragged_paged_attention_gpu
from tests.kernels.batch_factory import Batch, dense_reference, make_batch


def _rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _check(b: Batch, *, sm_scale: float, soft_cap: float | None = None,
           sliding_window: int | None = None, tiling: Tiling | None = None) -> None:
    out = ragged_paged_attention_gpu(*b.args(), sm_scale=sm_scale, soft_cap=soft_cap,
                                     sliding_window=sliding_window, tiling=tiling,
                                     interpret=True)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert out.shape == b.q.shape
    assert not np.isnan(out).any(), f"{np.isnan(out).any(axis=(1, 2)).sum()} rows not written"
    dense = dense_reference(b, sm_scale=sm_scale, soft_cap=soft_cap,
                            sliding_window=sliding_window)
    tol = 1e-5 if b.q.dtype == jnp.float32 else 2e-2
    assert _rel_err(out, dense) < tol
    ref = ragged_paged_attention_reference(*b.args(), sm_scale=sm_scale, soft_cap=soft_cap,
                                           sliding_window=sliding_window)
    assert _rel_err(out, np.asarray(ref.astype(jnp.float32), np.float64)) < tol
    live_end = int(np.asarray(b.query_start_loc)[int(b.num_seqs[0])])
    assert (out[live_end:] == 0).all(), "padding token rows must be zeros"


# (block size, query heads, KV heads, head dim, dtype)
_GRID = [
    (16, 8, 2, 64, jnp.float32),
    (16, 32, 8, 128, jnp.bfloat16),
    (32, 8, 8, 64, jnp.bfloat16),
    (32, 16, 2, 128, jnp.float32),
    (64, 8, 1, 64, jnp.bfloat16),
    (64, 4, 4, 128, jnp.float32),
    (16, 9, 3, 64, jnp.bfloat16),  # G = 3 (SmolLM2): padded to 4 rows per KV head
]


@pytest.mark.parametrize("block,n,k,h,dtype", _GRID)
def test_mixed_batch_matches_dense(block, n, k, h, dtype):
    """Decodes with lengths 1, P-1, P, P+1 and long, then prefill chunks with and without context."""
    rng = np.random.default_rng(block * 1000 + n * 10 + k + h)
    p = block
    b = make_batch(rng, q_lens=[1, 1, 1, 1, 1, 3, 2 * p + 5, p + 1],
                   ctx_lens=[0, p - 2, p - 1, p, 3 * p + 7, 0, 0, 2 * p - 3],
                   num_heads=n, num_kv_heads=k, head_dim=h, block_size=p, dtype=dtype,
                   pad_slots=2, pad_tokens=5)
    _check(b, sm_scale=h ** -0.5)


@pytest.mark.parametrize("soft_cap,window", [(None, 5), (20.0, None), (10.0, 37)])
def test_soft_cap_and_sliding_window(soft_cap, window):
    rng = np.random.default_rng(7 + (window or 0))
    b = make_batch(rng, q_lens=[1, 1, 40, 7], ctx_lens=[70, 3, 10, 50], num_heads=8,
                   num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float32, pad_slots=1)
    # A large scale makes the cap bite.
    _check(b, sm_scale=1.0 if soft_cap else 0.125, soft_cap=soft_cap, sliding_window=window)


@pytest.mark.parametrize("target", [1, 100_000])
def test_split_counts(target):
    """target 1: one split per sequence (direct write); huge: max_splits, most splits empty."""
    rng = np.random.default_rng(target)
    b = make_batch(rng, q_lens=[1, 1, 1, 9], ctx_lens=[200, 17, 0, 30], num_heads=8,
                   num_kv_heads=4, head_dim=64, block_size=16, dtype=jnp.float32, pad_slots=3)
    _check(b, sm_scale=0.125, tiling=Tiling(target_programs=target, max_splits=8))


@pytest.mark.parametrize("target", [2, 12])
def test_prefill_programs_loop_over_tiles(target):
    """Fewer prefill programs than tiles (target_programs 2 or 12 over 4 KV heads: one or three
    a head): each program walks its share of the virtual tiles (chunks of several tiles, decode
    rows, the padding rows), and every row still comes out right."""
    rng = np.random.default_rng(40 + target)
    b = make_batch(rng, q_lens=[1, 37, 1, 70, 5], ctx_lens=[60, 0, 3, 21, 9], num_heads=8,
                   num_kv_heads=4, head_dim=64, block_size=16, dtype=jnp.float32, pad_slots=2,
                   pad_tokens=11)
    _check(b, sm_scale=0.125, tiling=Tiling(target_programs=target, prefill_rows=32))


@pytest.mark.parametrize("pad_tokens", [0, 4])
def test_decode_step_with_and_without_padding(pad_tokens):
    """A step of decode rows only: with no padding rows the prefill programs find nothing to do
    and leave at once; with padding rows they zero them."""
    rng = np.random.default_rng(50 + pad_tokens)
    b = make_batch(rng, q_lens=[1] * 5, ctx_lens=[3, 40, 0, 17, 99], num_heads=8, num_kv_heads=2,
                   head_dim=64, block_size=16, dtype=jnp.float32, pad_tokens=pad_tokens)
    _check(b, sm_scale=0.125)


@pytest.mark.parametrize("growth", [0.02, 0.5])
def test_rising_max_rescales_every_step(growth):
    """Keys scaled by 1 + growth x position: each KV step's scores pass the earlier ones (by a
    few units, or by ~100 in base 2: an unrescaled sum would overflow float32), so the online
    softmax rescales what it has at every step, decode rows and chunks alike, with and
    without splits."""
    rng = np.random.default_rng(int(growth * 100))
    b = make_batch(rng, q_lens=[1, 1, 7, 20], ctx_lens=[300, 90, 150, 40], num_heads=8,
                   num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float32, pad_tokens=3,
                   key_growth=growth)
    _check(b, sm_scale=0.125)
    _check(b, sm_scale=0.125, tiling=Tiling(target_programs=100_000, max_splits=8))


def test_many_splits_merge_in_chunks():
    """G = 8 and up to 64 splits: the merging split combines partials in several chunks."""
    rng = np.random.default_rng(21)
    b = make_batch(rng, q_lens=[1, 1, 3], ctx_lens=[2100, 300, 9], num_heads=8, num_kv_heads=1,
                   head_dim=64, block_size=16, dtype=jnp.float32, pad_slots=1)
    _check(b, sm_scale=0.125, tiling=Tiling(target_programs=100_000, max_splits=64))


def test_window_with_unmasked_middle_tiles():
    """Small tiles so a window leaves masked tiles below, unmasked ones in the middle, and the
    diagonal masked: all three prefill loops run."""
    rng = np.random.default_rng(22)
    b = make_batch(rng, q_lens=[50, 1, 23], ctx_lens=[100, 70, 0], num_heads=8, num_kv_heads=2,
                   head_dim=64, block_size=16, dtype=jnp.float32)
    _check(b, sm_scale=0.125, sliding_window=40,
           tiling=Tiling(prefill_rows=16, prefill_block_kv=16))
    _check(b, sm_scale=0.125, tiling=Tiling(prefill_rows=16, prefill_block_kv=16))


def test_prefill_only_multi_tile_and_decode_only():
    rng = np.random.default_rng(11)
    tiling = Tiling(prefill_rows=16)  # 4 tokens per tile at G = 4: many tiles per chunk
    b = make_batch(rng, q_lens=[13, 2, 6], ctx_lens=[5, 30, 0], num_heads=8, num_kv_heads=2,
                   head_dim=64, block_size=16, dtype=jnp.float32, pad_tokens=2)
    _check(b, sm_scale=0.125, tiling=tiling)
    b = make_batch(rng, q_lens=[1] * 6, ctx_lens=[0, 5, 15, 16, 33, 90], num_heads=8,
                   num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float32, pad_slots=2)
    _check(b, sm_scale=0.125)


@pytest.mark.parametrize("flag,q_lens,pad_tokens", [("decode_only", [1, 1, 1], 5),
                                                    ("prefill_only", [5, 40, 17], 6)])
def test_one_kind_steps_skip_the_other_kernel(flag, q_lens, pad_tokens):
    """decode_only / prefill_only: a step of one kind launches one kernel; its rows match the
    reference and the padding rows are zero (their queries are NaN, so they must not be read)."""
    rng = np.random.default_rng(3)
    b = make_batch(rng, q_lens=q_lens, ctx_lens=[0, 37, 100], num_heads=4, num_kv_heads=2,
                   head_dim=16, block_size=16, dtype=jnp.float32, pad_slots=2,
                   pad_tokens=pad_tokens)
    live = sum(q_lens)
    args = (b.q.at[live:].set(jnp.nan), *b.args()[1:])
    got = ragged_paged_attention_gpu(*args, sm_scale=0.25, interpret=True, **{flag: True})
    ref = ragged_paged_attention_reference(*args, sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)
    assert (np.asarray(got)[live:] == 0).all()


def test_no_live_sequences_gives_zeros():
    rng = np.random.default_rng(3)
    b = make_batch(rng, q_lens=[4], ctx_lens=[3], num_heads=4, num_kv_heads=2, head_dim=64,
                   block_size=16, dtype=jnp.float32, pad_slots=2)
    b = Batch(*b.args()[:6], num_seqs=jnp.zeros((1,), jnp.int32))
    out = ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, interpret=True)
    assert (np.asarray(out) == 0).all()


def test_padded_slots_ignore_garbage_tables():
    """Padded slots' tables and kv_lens are never read (kv_lens of a padded slot are ignored)."""
    rng = np.random.default_rng(5)
    b = make_batch(rng, q_lens=[1, 6], ctx_lens=[20, 4], num_heads=4, num_kv_heads=1,
                   head_dim=64, block_size=16, dtype=jnp.float32, pad_slots=3, pad_tokens=4)
    bt = np.asarray(b.block_tables).copy()
    bt[2:] = rng.integers(0, b.k_cache.shape[0], bt[2:].shape)
    kvl = np.asarray(b.kv_lens).copy()
    kvl[2:] = 17
    b2 = Batch(b.q, b.k_cache, b.v_cache, jnp.asarray(kvl), jnp.asarray(bt),
               b.query_start_loc, b.num_seqs)
    out1 = ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, interpret=True)
    out2 = ragged_paged_attention_gpu(*b2.args(), sm_scale=0.1, interpret=True)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))


def test_bad_inputs_raise_value_error():
    rng = np.random.default_rng(0)
    b = make_batch(rng, q_lens=[1, 3], ctx_lens=[2, 0], num_heads=4, num_kv_heads=2,
                   head_dim=64, block_size=16, dtype=jnp.float32)
    a = list(b.args())
    cases = [
        (0, a[0][:, :3], "multiple of KV heads"),
        (0, a[0].astype(jnp.float16), "q dtype"),
        (1, a[1].astype(jnp.bfloat16), "dtype"),
        (2, a[2][:, :, :8], "v_cache shape"),
        (3, a[3].astype(jnp.int64) if jax.config.jax_enable_x64 else a[3].astype(jnp.float32),
         "kv_lens dtype"),
        (4, a[4][None], "block_tables"),
        (5, a[5][:-1], "query_start_loc shape"),
        (6, jnp.zeros((2,), jnp.int32), "num_seqs shape"),
        (0, a[0][..., :48], "head dim"),
    ]
    for i, bad, msg in cases:
        args = list(a)
        args[i] = bad
        with pytest.raises(ValueError, match=msg):
            ragged_paged_attention_gpu(*args, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention_gpu(*a, sm_scale=0.1, sliding_window=0, interpret=True)
    with pytest.raises(ValueError, match="soft_cap"):
        ragged_paged_attention_gpu(*a, sm_scale=0.1, soft_cap=-1.0, interpret=True)
    with pytest.raises(ValueError, match="Tiling.prefill_rows"):
        Tiling(prefill_rows=24)
    with pytest.raises(ValueError, match="decode_only and prefill_only cannot both be set"):
        ragged_paged_attention_gpu(*a, sm_scale=0.1, interpret=True, decode_only=True,
                                   prefill_only=True)


def test_backend_off_gpu_is_none():
    if jax.default_backend() != "gpu":
        assert gpu_backend.get_kernel() is None


def test_mosaic_prefill_only_from_min_tokens(monkeypatch):
    """The engine's Mosaic-prefill kernel takes the Mosaic kernel ("auto") from
    MOSAIC_PREFILL_MIN_TOKENS token rows up and the Triton kernels below (fewer Mosaic kernels
    to compile in every process); checked with a stand-in Hopper device and kernel."""
    import types
    from jaxengine.pallas_kernels import ragged_paged_attention_gpu as rpa_gpu

    calls = []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(
        compute_capability="9.0", core_count=132, device_kind="H100")])
    monkeypatch.setattr(rpa_gpu, "ragged_paged_attention_gpu",
                        lambda q, *a, **kw: calls.append((q.shape[0], kw["prefill"],
                                                          kw["tiling"].mosaic.sm_count)))
    fn = gpu_backend.get_kernel(mosaic_prefill=True)
    low = gpu_backend.MOSAIC_PREFILL_MIN_TOKENS
    for t in (16, low // 2, low, 4 * low):
        fn(jax.ShapeDtypeStruct((t, 32, 128), jnp.bfloat16), sm_scale=0.1)
    assert calls == [(16, "triton", 132), (low // 2, "triton", 132), (low, "auto", 132),
                     (4 * low, "auto", 132)]
    calls.clear()
    gpu_backend.get_kernel(mosaic_prefill=True, min_tokens=8)(
        jax.ShapeDtypeStruct((16, 32, 128), jnp.bfloat16), sm_scale=0.1)
    assert calls == [(16, "auto", 132)]
    assert gpu_backend.get_kernel() is rpa_gpu.ragged_paged_attention_gpu  # plain: no wrapper
    # what the engine logs as its attention: whether the model's shape gets the Mosaic kernel
    assert fn.mosaic_applies(jnp.bfloat16, 128, 4, 16)  # Llama-3-8B
    assert not fn.mosaic_applies(jnp.bfloat16, 64, 3, 16)  # SmolLM2-135M: G = 3
    assert not fn.mosaic_applies(jnp.bfloat16, 128, 4, 16, sliding_window=4096)



def test_tiling_fits_shared_memory():
    """Head size 256 (Gemma) and float32 get tiles that fit Hopper's shared memory; bf16 head
    sizes up to 128 keep the default tiling; the estimate reproduces what Triton asked for on an
    H200 (lab/kernels/smem_probe.py) where that was exact."""
    from jaxengine.pallas_kernels.ragged_paged_attention_gpu import fit_shared_memory, smem_estimate

    hopper = 232448
    assert smem_estimate(128, 128, 2, 256, 2) == 327680  # prefill, bf16, head 256, 2 stages
    assert smem_estimate(64, 128, 2, 256, 2) == 294912
    assert smem_estimate(128, 128, 1, 256, 4) == 393216  # 1 stage, float32
    assert smem_estimate(16, 128, 1, 256, 4) == 278528  # decode, float32, head 256
    assert fit_shared_memory(Tiling(), 128, 2, 4, hopper) == Tiling()
    assert fit_shared_memory(Tiling(), 64, 4, 3, hopper) == Tiling()
    t = fit_shared_memory(Tiling(), 256, 2, 2, hopper)
    assert (t.prefill_rows, t.prefill_block_kv, t.decode_block_kv) == (128, 64, 64)  # ran on the H200
    for h, itemsize, g, smem in ((256, 2, 2, hopper), (256, 4, 2, hopper), (128, 4, 1, hopper),
                                 (256, 2, 8, 166912), (128, 2, 4, 101376)):
        t = fit_shared_memory(Tiling(), h, itemsize, g, smem)
        assert smem_estimate(t.prefill_rows, t.prefill_block_kv, min(t.prefill_num_stages, 2), h,
                             itemsize) <= smem - 8192
        assert smem_estimate(max(16, g), t.decode_block_kv, 1, h, itemsize) <= smem - 8192
        assert t.prefill_rows >= g and t.prefill_block_kv >= 16 and t.decode_block_kv >= 16
