"""The fp8-weight matmul kernel (Pallas, Triton lowering; W8A16 for decode rows) in interpret
mode against its jnp reference and against the model's W8A8 reference, and lowered for an H100."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.models.quantization import quantize_fp8
from jaxengine.pallas_kernels.fp8_matmul_gpu import fp8_matmul_reference, fp8_weight_matmul, supported


def _weight(n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.normal(scale=0.05, size=(k, n)).astype(np.float32)  # the model's [K, N] layout
    return w, quantize_fp8(jnp.asarray(w), 1)


@pytest.mark.parametrize("t,k,n,splits", [(1, 256, 128, None), (5, 512, 256, 4), (17, 384, 128, 1), (16, 1024, 384, 2)])
def test_kernel_matches_reference_float32(t, k, n, splits):
    """Ragged row counts, K split or not: the exactly converted weights times x, then the scale."""
    _, q = _weight(n, k, seed=t + k)
    x = jnp.asarray(np.random.default_rng(t).normal(size=(t, k)), jnp.float32)
    want = fp8_matmul_reference(x, q.qweight, q.scale)
    got = fp8_weight_matmul(x, q.qweight, q.scale, splits=splits, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_kernel_close_to_the_unquantized_weight_in_bfloat16():
    """bf16 activations: within e4m3's rounding of the plain bf16 product."""
    w, q = _weight(256, 512, seed=1)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 512)), jnp.bfloat16)
    got = np.asarray(fp8_weight_matmul(x, q.qweight, q.scale, interpret=True).astype(jnp.float32))
    want = np.asarray(x.astype(jnp.float32)) @ w
    assert np.max(np.abs(got - want)) <= 0.06 * np.max(np.abs(want))


def test_unsupported_shapes_refused():
    assert supported(1, 256, 128) and not supported(1, 96, 128) and not supported(1, 256, 100)
    _, q = _weight(128, 256, seed=0)
    with pytest.raises(ValueError, match="unsupported shapes"):
        fp8_weight_matmul(jnp.zeros((1, 96)), q.qweight[:, :96], q.scale, interpret=True)


def test_kernel_lowers_for_an_h100():
    """The e4m3 load, its conversion and the transposed dot lower through Triton."""
    from tests.kernels.cuda_target import abstract_h100

    _, q = _weight(256, 512, seed=3)
    x = jnp.zeros((16, 512), jnp.bfloat16)
    with abstract_h100():
        text = jax.jit(fp8_weight_matmul).trace(x, q.qweight, q.scale).lower(lowering_platforms=("cuda",)).as_text()
    assert "fp8_weight_matmul" in text


@pytest.mark.parametrize("path", ["xla", "kernel"])
def test_fp8_linear_paths_on_gpu(monkeypatch, path):
    """The model's fp8 matmul on a GPU (faked here): up to FP8_KERNEL_MAX_ROWS rows the weight
    converted in the graph (`FP8_DECODE="xla"`, the default) or the Pallas kernel ("kernel"), the
    W8A8 path (activations quantized) above; each close to the dequantized product."""
    from jaxengine.models import quantization as qz

    monkeypatch.setattr(qz, "FP8_DECODE", path)
    calls = []

    def fake_kernel(x, qweight, scale, num_warps):
        calls.append(x.shape[0])
        return fp8_weight_matmul(x, qweight, scale, interpret=True)

    monkeypatch.setattr(qz.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(qz.fp8_kernel, "fp8_weight_matmul", fake_kernel)
    w, q = _weight(128, 256, seed=5)
    for t in (3, qz.FP8_KERNEL_MAX_ROWS + 1):
        x = jnp.asarray(np.random.default_rng(t).normal(size=(t, 256)), jnp.float32)
        got = np.asarray(qz.fp8_matmul(x, q.qweight, q.scale, None))
        want = np.asarray(x) @ w
        assert np.max(np.abs(got - want)) <= 0.08 * np.max(np.abs(want))
        if t <= qz.FP8_KERNEL_MAX_ROWS and path == "xla":  # the exactly converted weight: x's rounding only
            exact = np.asarray(x) @ np.asarray(fp8_matmul_reference(jnp.eye(256, dtype=jnp.float32), q.qweight, q.scale))
            np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
    assert calls == ([3] if path == "kernel" else [])


@pytest.mark.parametrize("gemm_out,want_type", [("input", "bf16"), ("float32", "f32")])
def test_w8a8_gemm_output_type_on_gpu(monkeypatch, gemm_out, want_type):
    """On GPU the W8A8 GEMM writes bf16 activations' product in bf16 (FP8_GEMM_OUT="input", the
    default) or float32, behind an optimization barrier on x; both close to the exact product."""
    from jaxengine.models import quantization as qz

    monkeypatch.setattr(qz.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(qz, "FP8_GEMM_OUT", gemm_out)
    w, q = _weight(128, 256, seed=7)
    x = jnp.asarray(np.random.default_rng(8).normal(size=(32, 256)), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda a: qz.fp8_matmul(a, q.qweight, q.scale, None))(x))
    assert f"preferred_element_type={'bfloat16' if want_type == 'bf16' else 'float32'}" in jaxpr
    assert "optimization_barrier" in jaxpr
    got = np.asarray(qz.fp8_matmul(x, q.qweight, q.scale, None).astype(jnp.float32))
    want = np.asarray(x.astype(jnp.float32)) @ w
    assert np.max(np.abs(got - want)) <= 0.08 * np.max(np.abs(want))
