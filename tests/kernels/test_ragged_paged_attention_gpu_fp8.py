"""The Triton-lowered GPU kernels over an fp8 (float8_e4m3fn) KV cache, in Pallas' interpreter.

Checked against the jnp reference over the same fp8 cache upcast to float32 (times its scales):
the kernels must compute the same attention, up to q's dtype. Against a bf16 cache holding the
unrounded values, the fp8 rounding itself: within FP8_KV_RTOL. Also: the Triton modules for CUDA
convert the e4m3 tiles in registers (tt.fp_to_fp), and the Mosaic prefill kernel never takes an
fp8 cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from jaxengine.pallas_kernels.ragged_paged_attention_gpu import Tiling, ragged_paged_attention_gpu
from tests.kernels.batch_factory import Batch, make_batch
from tests.kernels.cuda_target import abstract_h100

FP8 = jnp.float8_e4m3fn
# Relative (Frobenius) error of attention over an e4m3 cache against the bf16 cache it was
# rounded from: e4m3 keeps 3 mantissa bits (relative rounding error up to 2**-4, RMS ~0.036 on
# unit-normal K/V); measured 0.026-0.033 on the batches below.
FP8_KV_RTOL = 0.06


def _rel_err(out, ref) -> float:
    out, ref = (np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in (out, ref))
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _fp8(b: Batch) -> Batch:
    """The batch with its caches rounded to e4m3 (scale 1.0)."""
    return Batch(b.q, b.k_cache.astype(FP8), b.v_cache.astype(FP8), *b.args()[3:])


def _reference(b: Batch, *, k_scale: float = 1.0, v_scale: float = 1.0, **kw) -> jax.Array:
    """The jnp reference over the cache dequantized to float32."""
    kc, vc = b.k_cache.astype(jnp.float32) * k_scale, b.v_cache.astype(jnp.float32) * v_scale
    return ragged_paged_attention_reference(b.q.astype(jnp.float32), kc, vc, *b.args()[3:], **kw)


def _mixed(rng, dtype, p=16, **kw) -> Batch:
    """Decodes of lengths 1, P-1, P+1 and long, prefill chunks with and without context, padding."""
    return make_batch(rng, q_lens=[1, 1, 1, 1, 3, 2 * p + 5, p + 1], ctx_lens=[0, p - 2, p, 3 * p + 7, 0, 0, 2 * p - 3],
                      num_heads=8, num_kv_heads=2, head_dim=32, block_size=p, dtype=dtype, pad_slots=1,
                      pad_tokens=3, **kw)


def _check(b_exact: Batch, tol: float, *, tiling: Tiling, **kw) -> None:
    """The kernels over `b_exact` with its caches rounded to e4m3 match the reference over the
    same fp8 cache within `tol` (q's precision), and the reference over the unrounded cache
    within FP8_KV_RTOL (what fp8 costs); padding rows zero; every row written (interpret mode
    leaves unwritten rows NaN)."""
    b = _fp8(b_exact)
    out = ragged_paged_attention_gpu(*b.args(), **kw, tiling=tiling, interpret=True)
    assert out.dtype == b.q.dtype and not np.isnan(np.asarray(out, np.float32)).any()
    assert _rel_err(out, _reference(b, **kw)) < tol
    assert (np.asarray(out[int(b.query_start_loc[int(b.num_seqs[0])]):], np.float32) == 0).all()
    err = _rel_err(out, _reference(b_exact, **kw))
    assert 1e-3 < err < FP8_KV_RTOL, err  # not zero: the cache really was rounded


def test_mixed_batch_with_scales():
    """float32 queries: decode rows of several KV splits each (merged by the last to arrive)
    and prefill chunks, with k/v scales other than 1; tight against the same cache."""
    _check(_mixed(np.random.default_rng(1), jnp.float32), 1e-5, sm_scale=0.125, k_scale=0.5, v_scale=3.0,
           tiling=Tiling(target_programs=32, max_splits=4))


def test_bf16_queries_window_soft_cap_and_unmasked_tiles():
    """bf16 queries (the tiles upcast to bf16 for bf16 dots); small prefill tiles so that a
    window leaves masked tiles below, unmasked ones (loaded without a mask, then upcast) in the
    middle and the masked diagonal; a soft cap; a decode row beside the chunks."""
    b = make_batch(np.random.default_rng(2), q_lens=[20, 1, 6], ctx_lens=[60, 40, 0], num_heads=4,
                   num_kv_heads=1, head_dim=32, block_size=16, dtype=jnp.bfloat16, pad_tokens=2)
    _check(b, 1e-2, sm_scale=0.25, soft_cap=10.0, sliding_window=40,
           tiling=Tiling(prefill_rows=16, prefill_block_kv=16))


def test_bad_fp8_inputs_raise_value_error():
    b = _fp8(make_batch(np.random.default_rng(0), q_lens=[1, 3], ctx_lens=[2, 0], num_heads=4, num_kv_heads=2,
                        head_dim=16, block_size=16, dtype=jnp.bfloat16))
    a = list(b.args())
    with pytest.raises(ValueError, match="must match q dtype .* or both be float8_e4m3fn"):
        ragged_paged_attention_gpu(a[0], a[1], a[2].astype(jnp.bfloat16), *a[3:], sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="must match q dtype"):
        ragged_paged_attention_gpu(a[0], a[1].astype(jnp.float8_e5m2), a[2].astype(jnp.float8_e5m2), *a[3:],
                                   sm_scale=0.1, interpret=True)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="v_scale must be a positive finite float"):
            ragged_paged_attention_gpu(*a, sm_scale=0.1, v_scale=bad, interpret=True)
    with pytest.raises(ValueError, match="prefill='mosaic' cannot serve this call .*cache dtype float8_e4m3fn"):
        ragged_paged_attention_gpu(*a, sm_scale=0.1, prefill="mosaic", interpret=True)


def _triton_modules(monkeypatch, lower) -> list[str]:
    """The Triton modules (text, no debug info) that `lower()` builds."""
    lowering = pytest.importorskip("jax._src.pallas.triton.lowering")
    build = getattr(lowering, "lower_jaxpr_to_triton_module", None)
    if build is None:
        pytest.skip("this jax has no Triton module builder to observe")
    seen = []

    def capture(*a, **kw):
        result = build(*a, **kw)
        seen.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    with abstract_h100():
        text = lower().as_text()
    assert "mosaic_gpu" not in text  # "auto" keeps an fp8 cache on the Triton kernels
    return seen


@pytest.mark.parametrize("dtype,ir", [(jnp.bfloat16, "bf16"), (jnp.float32, "f32")])
def test_lowers_for_cuda_with_the_upcast_in_registers(monkeypatch, dtype, ir):
    """The real (non-interpret) lowering for an H100: both kernels read the cache as e4m3 and
    convert the tiles to q's dtype (tt.fp_to_fp, which Triton runs on sm_89+), even with
    prefill="auto" and a shape the Mosaic prefill kernel would take in bf16."""
    t, n, k, h, p, s, m, blocks = 512, 32, 8, 128, 16, 4, 16, 64
    sd = jax.ShapeDtypeStruct
    args = (sd((t, n, h), dtype), sd((blocks, k, p, h), FP8), sd((blocks, k, p, h), FP8), sd((s,), jnp.int32),
            sd((s, m), jnp.int32), sd((s + 1,), jnp.int32), sd((1,), jnp.int32))
    modules = _triton_modules(monkeypatch, lambda: ragged_paged_attention_gpu.trace(
        *args, sm_scale=h ** -0.5, prefill="auto").lower(lowering_platforms=("cuda",)))
    assert len(modules) == 2  # decode, prefill
    for text in modules:
        assert "tensor<64x128xf8E4M3FN>" in text or "tensor<128x128xf8E4M3FN>" in text
        assert "xf8E4M3FN> -> tensor<" in text and "tt.fp_to_fp" in text
        assert all(line.rstrip().endswith(f"x{ir}>") for line in text.splitlines() if "tt.fp_to_fp" in line)
