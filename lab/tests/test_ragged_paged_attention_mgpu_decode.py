"""The Mosaic GPU decode kernel (lab/kernels/ragged_paged_attention_mgpu_decode.py) on the CPU:
what can be checked without a Hopper GPU.

- The kernel lowers for CUDA (Mosaic GPU's layout, TMA and cluster checks run at lowering):
  one split and a cluster of splits, block ids by whole-row copies (one and two per row), by
  windows and by scalar reads, zeroed padding rows
  (before the Mosaic prefill kernel), decode-only calls; the transposed form (heads as columns)
  where jax >= 0.11.
- Its static choices: splits per row, row-walking clusters, the block-id window, the shared
  memory budget, the form, and the KV ranges of the splits (every step exactly once, split 0
  never empty).
- The split merge's arithmetic turns per-split softmax results into the full softmax, empty
  splits included: `merge_split_rows` (plain jnp, the prefill kernel's) and the decode kernel's
  matmul forms (`merge_weights` @ a tile of every split's rows; in the transposed form
  sum_c `column_weights` @ tile_c^T; weights as two 16-bit parts).
- Options are validated with clear errors; the lab wrapper's decode= choice as the product's
  prefill= (triton / mosaic / auto).
The kernel body runs on the H100 (lab/kernels/bench_paged_attention.py --mosaic-decode:
correctness cases and timings in lab/results/kernels_h100_mosaic_decode.*).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.pallas_kernels.ragged_paged_attention_mgpu import merge_split_rows, split_steps
from lab.kernels import ragged_paged_attention_mgpu_decode as dec
from lab.kernels.ragged_paged_attention_mgpu_decode import (
    DecodeTiling, Tiling, ragged_paged_attention_gpu)
from tests.kernels.batch_factory import make_batch
from tests.kernels.cuda_target import abstract_h100, mosaic_modules_with_and_without_scopes


def _lower(t, s, m, n, k, h, p, *, prefill="triton", decode_only=False, **tiling):
    sd = jax.ShapeDtypeStruct
    blocks = 64
    args = (sd((t, n, h), jnp.bfloat16), sd((blocks, k, p, h), jnp.bfloat16),
            sd((blocks, k, p, h), jnp.bfloat16), sd((s,), jnp.int32), sd((s, m), jnp.int32),
            sd((s + 1,), jnp.int32), sd((1,), jnp.int32))
    with abstract_h100():
        return ragged_paged_attention_gpu.trace(
            *args, sm_scale=h ** -0.5, prefill=prefill, decode="mosaic", decode_only=decode_only,
            tiling=Tiling(mosaic_decode=DecodeTiling(**tiling))
        ).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("t,s,m,n,k,h,p,prefill,decode_only", [
    (1, 1, 64, 32, 8, 128, 16, "triton", False),   # 8 splits (a cluster), whole-row block ids
    (8, 8, 13, 16, 2, 64, 32, "mosaic", False),    # splits, scalar block ids, zeroed padding
    (64, 64, 128, 32, 8, 128, 16, "triton", True),  # 1 split, decode-only
    (8, 2, 512, 32, 8, 128, 16, "mosaic", False),  # whole rows by 2 copies, zeroed padding
    (2, 2, 300, 32, 8, 128, 16, "triton", True),   # block ids by windows of 256
])
def test_mosaic_decode_lowers_for_cuda(t, s, m, n, k, h, p, prefill, decode_only):
    text = _lower(t, s, m, n, k, h, p, prefill=prefill, decode_only=decode_only)
    assert "rpa_decode_mosaic" in text
    assert '"rpa_decode"' not in text  # the Triton decode kernel is replaced
    assert ('"rpa_prefill"' in text) == (prefill == "triton" and not decode_only)  # Triton's
    mosaic_calls = re.findall(r"custom_call @mosaic_gpu", text)
    assert len(mosaic_calls) == (2 if prefill == "mosaic" else 1)  # + the Mosaic prefill kernel


_NEW_JAX = jax.__version_info__ >= (0, 11)


@pytest.mark.skipif(not _NEW_JAX, reason="the transposed form needs jax >= 0.11")
@pytest.mark.parametrize("t,s,h", [(4, 4, 128), (2, 2, 64), (64, 64, 128)])  # 2, 4, 1 splits
def test_transposed_form_lowers_for_cuda(t, s, h):
    """The heads-as-columns form (default for clusters of up to 4 CTAs) lowers, and differs
    from the row form."""
    m, n, k, p = 64, 32, 8, 16
    assert dec.num_splits(t, k, DecodeTiling()) in (1, 2, 4)
    auto = _lower(t, s, m, n, k, h, p, decode_only=True)
    forced = _lower(t, s, m, n, k, h, p, decode_only=True, transposed=True)
    rows = _lower(t, s, m, n, k, h, p, decode_only=True, transposed=False)
    assert "rpa_decode_mosaic" in auto and auto != rows and forced != rows
    if t < 64:  # the merge scratch holds O^T tiles [H, 16] per split (rows: [8, H])
        assert f"x{h}x16xbf16" in auto and f"x{h}x16xbf16" not in rows


def test_transposed_choice():
    t = DecodeTiling()
    assert [dec.use_transposed(c, t) for c in (1, 2, 4, 5, 8)] == [_NEW_JAX] * 3 + [False] * 2
    if _NEW_JAX:
        assert dec.use_transposed(8, DecodeTiling(transposed=True))
        assert dec.smem_bytes(128, 2, t) <= 227 * 1024
    else:
        with pytest.raises(ValueError, match="transposed needs jax >= 0.11"):
            DecodeTiling(transposed=True)
    assert not dec.use_transposed(2, DecodeTiling(transposed=False))


def test_splits_walkers_and_block_id_window():
    t = DecodeTiling()
    # K x rows x splits reaches half the SMs (66 of 132): 8 KV heads x 8 rows take 1 split.
    assert [dec.num_splits(rows, 8, t) for rows in (1, 2, 4, 8, 16, 256)] == [8, 4, 2, 1, 1, 1]
    assert [dec.num_splits(rows, 2, t) for rows in (1, 4, 8, 32, 33)] == [8, 8, 4, 1, 1]
    assert dec.num_splits(1, 8, DecodeTiling(splits=3)) == 3
    # No more splits than the table's longest row has KV steps (512 keys: 4 of 128).
    assert [dec.num_splits(1, 8, t, max_steps=n) for n in (1, 4, 8, 64)] == [1, 4, 8, 8]
    assert dec.num_splits(1, 8, DecodeTiling(splits=8), max_steps=4) == 8  # as asked
    assert dec.num_row_walkers(256, 8, 1, t) == 33  # 2 CTAs per SM: 264 CTAs walk 256 rows
    assert dec.num_row_walkers(8, 8, 2, t) == 8
    assert dec.bt_window(64, 8) == 64 and dec.bt_window(300, 8) == 256
    assert dec.bt_window(132, 16) == 128
    assert dec.bt_window(16, 8) == 0    # under one 128-byte copy: scalar reads
    assert dec.bt_window(130, 8) == 0   # rows not 16-byte aligned: scalar reads
    # Whole table rows (fetched beside the row's metadata): multiples of 32 ids up to 1024,
    # in copies of up to 256 ids.
    assert [dec.bt_row_copies(m, 8) for m in (32, 64, 256, 512, 544, 1024)] == [1, 1, 1, 2, 3, 4]
    assert [dec.bt_row_copies(m, 8) for m in (13, 16, 132, 300, 1056)] == [0] * 5
    assert dec.bt_row_copies(32, 64) == 0 and dec.bt_row_copies(128, 64) == 1  # whole steps


def test_split_ranges_cover_every_step_once():
    for n_steps in range(0, 40):
        for splits in range(1, 9):
            ranges = [split_steps(n_steps, c, splits) for c in range(splits)]
            covered = [i for lo, hi in ranges for i in range(lo, hi)]
            assert covered == list(range(n_steps))
            assert n_steps == 0 or ranges[0][1] > ranges[0][0]


def test_smem_budget_and_support():
    t = DecodeTiling()
    assert dec.smem_bytes(128, 2, t) <= 227 * 1024
    assert dec.supported(jnp.bfloat16, 128, 4, 16, None, None, t)
    assert dec.supported(jnp.float16, 64, 8, 32, None, None, t)
    assert not dec.supported(jnp.float32, 128, 4, 16, None, None, t)
    assert not dec.supported(jnp.bfloat16, 128, 4, 16, 30.0, None, t)   # soft cap
    assert not dec.supported(jnp.bfloat16, 128, 4, 16, None, 128, t)    # sliding window
    assert not dec.supported(jnp.bfloat16, 128, 3, 16, None, None, t)   # G = 3
    assert not dec.supported(jnp.bfloat16, 256, 4, 16, None, None, t)   # head dim 256
    assert not dec.supported(jnp.bfloat16, 128, 4, 16, None, None, DecodeTiling(stages=4))


@pytest.mark.parametrize("splits", [2, 5, 8])
def test_split_merge_gives_the_full_softmax(splits):
    """Each split's rows normalised by its own sum plus its log2-sum-exp (as the kernel leaves
    them; an empty split: zeros and -inf) merge into softmax(s) @ v over all keys."""
    rng = np.random.default_rng(splits)
    rows, keys, h, bkv = 64, 300, 32, 64
    s = rng.standard_normal((rows, keys)) * 3
    v = rng.standard_normal((keys, h))
    n_steps = -(-keys // bkv)
    parts = []
    for c in range(splits):
        lo, hi = split_steps(n_steps, c, splits)
        k0, k1 = lo * bkv, min(hi * bkv, keys)
        if k1 <= k0:
            parts.append((np.full(rows, -np.inf), np.zeros((rows, h))))
            continue
        sc = s[:, k0:k1] * np.log2(np.e)  # the kernel's logits are in base 2
        m = sc.max(1)
        pr = np.exp2(sc - m[:, None])
        parts.append((m + np.log2(pr.sum(1)), pr @ v[k0:k1] / pr.sum(1)[:, None]))
    assert any(np.isinf(lse).all() for lse, _ in parts) == (splits > n_steps)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    got = merge_split_rows(f32(parts[0][0]), f32(parts[0][1]),
                           [(f32(lse), f32(o)) for lse, o in parts[1:]])
    p = np.exp(s - s.max(1, keepdims=True))
    want = (p / p.sum(1, keepdims=True)) @ v
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)

    # The decode kernel's form: split c's first 8 rows at rows 8c.. of one tile, merged by
    # W @ tile, W's 16-bit high and low parts as the kernel multiplies them (rows < 8 live).
    tile = np.zeros((64, h), np.float32)
    for c, (_, o) in enumerate(parts):
        tile[8 * c:8 * c + 8] = o[:8]
    w = dec.merge_weights([f32(lse) for lse, _ in parts])
    w_hi, w_lo = (x.astype(jnp.float32) for x in dec.hi_lo(w, jnp.bfloat16))
    assert float(jnp.abs(w - w_hi - w_lo).max()) < 1e-5  # the weights to ~2^-17
    np.testing.assert_allclose(np.asarray(w @ tile)[:8], want[:8], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray((w_hi + w_lo) @ tile)[:8], want[:8], atol=2e-5)
    np.testing.assert_allclose(np.asarray(w)[:8].sum(1), 1.0, rtol=1e-6)  # weights sum to 1

    # The transposed form: split c's O^T [H, 16] (16-bit, heads as columns) is tile c; the
    # rows come back as sum_c W_c @ tile_c^T, W_c [64, 16] split c's weight of each head on the
    # diagonal, as high and low 16-bit parts (16 heads here; rows < 8 live).
    lses16 = [f32(np.resize(lse, 16)) for lse, _ in parts]
    out = np.zeros((64, h), np.float32)
    for wc, (_, o) in zip(dec.split_weights(lses16), parts):
        tile_t = np.resize(o, (16, h)).T  # O^T [H, 16]
        w_hi, w_lo = (np.asarray(x, np.float32) for x in dec.hi_lo(dec.column_weights(wc),
                                                                   jnp.bfloat16))
        out += (w_hi + w_lo) @ tile_t.T
    np.testing.assert_allclose(out[:8], want[:8], atol=2e-5)
    assert not out[16:].any()  # rows past the 16 heads: zero weights


def test_decode_option_errors():
    # (prefill= choices: tests/kernels/test_ragged_paged_attention_mgpu.test_kernel_choice_errors)
    with pytest.raises(ValueError, match="block_kv must be a multiple of 64"):
        DecodeTiling(block_kv=96)
    with pytest.raises(ValueError, match="splits must be in"):
        DecodeTiling(splits=9)
    with pytest.raises(ValueError, match="stages must be >= 2"):
        DecodeTiling(stages=1)


def test_bench_decode_variant_names():
    """The kernel bench's decode paths by name (--decode-variants), the forms included."""
    from lab.kernels.bench_paged_attention import decode_variant

    tiling, kw = decode_variant(Tiling(), "mosaic-only:128x2:r")
    assert kw == {"decode": "mosaic", "decode_only": True}
    assert tiling.mosaic_decode.transposed is False and tiling.mosaic_decode.splits is None
    tiling, kw = decode_variant(Tiling(), "mosaic:64x4x8")
    assert kw == {"decode": "mosaic", "decode_only": False}
    assert (tiling.mosaic_decode.block_kv, tiling.mosaic_decode.stages,
            tiling.mosaic_decode.splits, tiling.mosaic_decode.transposed) == (64, 4, 8, None)
    assert decode_variant(Tiling(), "triton-only")[1] == {"decode": "triton", "decode_only": True}


def test_decode_choice_errors():
    """decode= takes triton / mosaic / auto; "mosaic" where this kernel cannot serve the call
    (soft cap; the interpreter) is a ValueError naming the option."""
    rng = np.random.default_rng(0)
    b = make_batch(rng, q_lens=[1, 9], ctx_lens=[3, 4], num_heads=8, num_kv_heads=2,
                   head_dim=64, block_size=16, dtype=jnp.bfloat16, pad_tokens=6)
    with pytest.raises(ValueError, match="decode must be 'triton', 'mosaic' or 'auto'"):
        ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, decode="cuda")
    with pytest.raises(ValueError, match="decode='mosaic' cannot serve this call"):
        ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, soft_cap=30.0, decode="mosaic")
    with pytest.raises(ValueError, match="decode='mosaic' cannot serve this call"):
        ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, interpret=True, decode="mosaic")


def test_auto_choice_falls_back_to_the_product_call():
    """decode="auto" where this kernel does not apply (the interpreter) gives the product
    kernel's result (as decode="triton" does: the product call itself)."""
    from jaxengine.pallas_kernels import ragged_paged_attention_gpu as gpu

    rng = np.random.default_rng(3)
    b = make_batch(rng, q_lens=[1, 5, 1], ctx_lens=[7, 3, 20], num_heads=4, num_kv_heads=2,
                   head_dim=16, block_size=16, dtype=jnp.float32, pad_tokens=2)
    tiling = Tiling(target_programs=4, max_splits=2)  # a small grid: the interpreter is slow
    want = np.asarray(gpu.ragged_paged_attention_gpu(*b.args(), sm_scale=0.25, interpret=True,
                                                     tiling=tiling))
    got = ragged_paged_attention_gpu(*b.args(), sm_scale=0.25, interpret=True, decode="auto",
                                     tiling=tiling)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_named_phases_leave_the_decode_kernel_unchanged(monkeypatch):
    """The decode kernel's `jax.named_scope` phases (for the profiler) change nothing when
    profiling is off: the Mosaic modules of a mixed call with both Mosaic kernels (decode,
    then prefill), printed without debug info, are the same with the scopes as with every scope
    made a no-op."""
    sd = jax.ShapeDtypeStruct
    t, s, m, blocks, n, k, h, p = 256, 8, 16, 64, 32, 8, 128, 16
    args = (sd((t, n, h), jnp.bfloat16), sd((blocks, k, p, h), jnp.bfloat16),
            sd((blocks, k, p, h), jnp.bfloat16), sd((s,), jnp.int32), sd((s, m), jnp.int32),
            sd((s + 1,), jnp.int32), sd((1,), jnp.int32))

    def lower_calls() -> None:
        ragged_paged_attention_gpu.trace(*args, sm_scale=h ** -0.5, prefill="mosaic",
                                         decode="mosaic").lower(lowering_platforms=("cuda",))

    with_scopes, without = mosaic_modules_with_and_without_scopes(monkeypatch, lower_calls)
    assert len(with_scopes) == 2 and with_scopes == without
