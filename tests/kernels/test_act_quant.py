"""The fused SiLU-mul-e4m3 kernel (pallas_kernels/act_quant_gpu.py) in interpret mode against its
jnp reference, lowered for an H100, and the fp8 MLP path that calls it (faked GPU) against the
unquantized product and the unfused path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.models import quantization as qz
from jaxengine.pallas_kernels import act_quant_gpu as ak


def _f32(a):
    return np.asarray(a.astype(jnp.float32))


@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("t,f,rows,scaled", [(4, 96, 1, False), (6, 64, 2, True), (3, 2048 * 2, 1, True)])
def test_kernel_matches_reference(dtype, t, f, rows, scaled, two_pass):
    """Several register tiles a row (F = 96: three of 32), two rows a program, the product's row
    and column scales applied on the read, in either form (the row held, or read twice): the same
    e4m3 values and row scales as the jnp reference."""
    rng = np.random.default_rng(t * f)
    gu = jnp.asarray(rng.normal(size=(t, 2 * f)) * (300.0 if scaled else 1.0), dtype)
    scales = ((jnp.asarray(rng.uniform(1e-3, 3e-3, t), jnp.float32),
               jnp.asarray(rng.uniform(1e-3, 3e-3, 2 * f), jnp.float32)) if scaled else ())
    q, s = ak.silu_mul_quant(gu, *scales, rows=rows, two_pass=two_pass, interpret=True)
    qr, sr = ak.silu_mul_quant_reference(gu, *scales)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (t, f) and s.shape == (t,)
    np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-6)
    np.testing.assert_array_equal(_f32(q), _f32(qr))


def test_dequantized_output_is_the_activation():
    """hq * scale is silu(gate) * up within e4m3's rounding (3 mantissa bits: 1/16 relative)."""
    gu = jnp.asarray(np.random.default_rng(0).normal(size=(5, 256)), jnp.float32)
    q, s = ak.silu_mul_quant(gu, interpret=True)
    g, u = np.split(np.asarray(gu), 2, axis=1)
    h = g / (1 + np.exp(-g)) * u
    got = _f32(q) * np.asarray(s)[:, None]
    assert np.all(np.abs(got - h) <= np.abs(h) / 16 + np.asarray(s)[:, None] * 2.0 ** -9)
    assert np.allclose(np.max(np.abs(_f32(q)), axis=1), 448.0)


def test_tiles_and_refused_shapes():
    assert ak.pick_chunk(14336) == 2048 and ak.pick_chunk(1536) == 512 and ak.pick_chunk(96) == 32
    assert ak.pick_chunk(18944) is None  # 74 tiles of 256: the unfused path
    assert not ak.supported(16, 18944) and ak.supported(16, 14336)
    with pytest.raises(ValueError, match="unsupported shape"):
        ak.silu_mul_quant(jnp.zeros((3, 2 * 18944)), interpret=True)
    with pytest.raises(ValueError, match="unsupported shape"):
        ak.silu_mul_quant(jnp.zeros((3, 128)), rows=2, interpret=True)
    with pytest.raises(ValueError, match="come together"):
        ak.silu_mul_quant(jnp.zeros((2, 128)), jnp.ones(2), interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        ak.silu_mul_quant(jnp.zeros((2, 128)), jnp.ones(3), jnp.ones(128), interpret=True)


@pytest.mark.parametrize("two_pass", [False, True])
def test_kernel_lowers_for_an_h100(two_pass):
    """The whole-row register tiles (or the two loops over the row), the e4m3 store and the scale
    vectors lower through Triton at the Llama-3-8B shape's width."""
    from tests.kernels.cuda_target import abstract_h100

    gu = jnp.zeros((256, 2 * 14336), jnp.bfloat16)
    fn = functools.partial(ak.silu_mul_quant, two_pass=two_pass)
    with abstract_h100():
        text = jax.jit(fn).trace(gu, jnp.ones(256), jnp.ones(2 * 14336)).lower(lowering_platforms=("cuda",)).as_text()
    assert "silu_mul_quant" in text


def _mlp_weights(d: int, f: int, seed: int):
    rng = np.random.default_rng(seed)
    w_gu = rng.normal(scale=0.1, size=(d, 2 * f)).astype(np.float32)
    w_down = rng.normal(scale=0.05, size=(f, d)).astype(np.float32)
    return w_gu, w_down, qz.quantize_fp8(w_gu, 1), qz.quantize_fp8(w_down, 1)


def test_gated_mlp_fp8_on_a_gpu_matches_the_unfused_path(monkeypatch):
    """On a GPU (faked) the fp8 MLP of more than FP8_KERNEL_MAX_ROWS rows runs the fused kernel and
    is as close to the unquantized MLP as the unfused W8A8 path."""
    t, d, f = 32, 64, 128
    w_gu, w_down, gu, down = _mlp_weights(d, f, seed=1)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(t, d)), jnp.bfloat16)
    y = _f32(x) @ w_gu
    exact = (y[:, :f] / (1 + np.exp(-y[:, :f])) * y[:, f:]) @ w_down
    yq = qz.qeinsum("TD,DF->TF", x, gu)
    unfused = _f32(qz.qeinsum("TF,FD->TD", jax.nn.silu(yq[:, :f]) * yq[:, f:], down))
    assert qz.gated_mlp_fp8(x, gu, down, "silu") is None  # not on this CPU

    calls = []
    real = ak.silu_mul_quant

    def fake_kernel(*args, two_pass):
        calls.append(args[0].shape)
        return real(*args, two_pass=two_pass, interpret=True)

    monkeypatch.setattr(qz.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(qz.act_quant_kernel, "silu_mul_quant", fake_kernel)
    fused = _f32(qz.gated_mlp_fp8(x, gu, down, "silu"))
    assert calls == [(t, 2 * f)]
    scale = np.max(np.abs(exact))
    err_fused, err_unfused = np.max(np.abs(fused - exact)) / scale, np.max(np.abs(unfused - exact)) / scale
    assert err_fused <= 0.1 and err_fused <= 1.5 * err_unfused
    # where it does not apply: decode rows, another activation, a static activation scale
    assert qz.gated_mlp_fp8(x[:qz.FP8_KERNEL_MAX_ROWS], gu, down, "silu") is None
    assert qz.gated_mlp_fp8(x, gu, down, "gelu_pytorch_tanh") is None
    static = qz.Fp8Weight(down.qweight, down.scale, jnp.float32(0.01), down.shape, down.in_ndim, static_input=True)
    assert qz.gated_mlp_fp8(x, gu, static, "silu") is None
    monkeypatch.setattr(qz, "FP8_FUSED_ACT_QUANT", False)
    assert qz.gated_mlp_fp8(x, gu, down, "silu") is None and len(calls) == 1


def test_mlp_takes_the_fused_path_when_it_applies(monkeypatch):
    """models.layers.MLP hands x and both weights to gated_mlp_fp8 first (fused gate/up, no LoRA)
    and returns its output when it gives one."""
    from flax import nnx

    from jaxengine.models import layers
    from jaxengine.models.config import ModelConfig

    cfg = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=8, fused_projections=True)
    mlp = layers.MLP(cfg, jnp.float32, nnx.Rngs(0))
    x = jnp.ones((4, 16), jnp.float32)
    plain = mlp(x)
    seen = []
    monkeypatch.setattr(layers, "gated_mlp_fp8", lambda x_, gu, down, act: seen.append(act) or jnp.full((4, 16), 7.0))
    assert np.all(np.asarray(mlp(x)) == 7.0) and seen == ["silu"]
    monkeypatch.setattr(layers, "gated_mlp_fp8", lambda *a: None)
    np.testing.assert_array_equal(np.asarray(mlp(x)), np.asarray(plain))
