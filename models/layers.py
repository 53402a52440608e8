"""Building blocks shared by the families: norms, activations, rotary embedding, MLPs.

Legend: T tokens, D model, F ffn, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models.config import ModelConfig, RopeScaling
from jaxengine.models.lora import LoRALayer
from jaxengine.models.quantization import QuantizedRows, fp8_rows_apply, gated_mlp_fp8, qeinsum, rmsnorm_fp8_rows


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)

    def into(self, x: jax.Array, weights: list) -> jax.Array | QuantizedRows:
        """self(x) for the linears `weights` that read it; where they are all W8A8 fp8
        (quantization.fp8_rows_apply), the same rows normed and quantized to e4m3 in one step."""
        if fp8_rows_apply(x.shape[0], weights):
            return rmsnorm_fp8_rows(x, self.weight[...], self.eps)
        return self(x)


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis, with a learned scale and shift, computed in float32."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


# Hugging Face activation names -> functions.
ACTIVATIONS = {
    "silu": jax.nn.silu, "swish": jax.nn.silu, "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # erf
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # tanh approximation (GPT-2)
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
}


def activation(name: str, arch: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"{arch}: activation {name!r} is not supported "
                         f"(supported: {', '.join(sorted(ACTIVATIONS))})") from None


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [H/2] with the config's scaling applied, and the factor cos and sin are
    multiplied by (1.0 except for yarn)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv.astype(np.float32), 1.0
    kind, factor = scaling.rope_type, scaling.factor
    if kind == "linear":
        return (inv / factor).astype(np.float32), 1.0
    if kind == "dynamic":
        # NTK-aware: a larger base, computed once for the scaled maximum length.
        max_len = scaling.original_max_position_embeddings * factor
        base = theta * ((factor * max_len / scaling.original_max_position_embeddings) - (factor - 1)) ** (
            head_dim / (head_dim - 2))
        return (1.0 / (base ** exponents)).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if kind == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling)
    # llama3: long wavelengths divided by factor, short kept, a smooth ramp between.
    low_wl = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wl = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wl = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wl - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = np.where(wl > low_wl, inv / factor, inv)
    mid = (wl <= low_wl) & (wl >= high_wl)
    scaled = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return scaled.astype(np.float32), 1.0


def _yarn_inv_freq(dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    """YaRN: dimensions that turn more than `beta_fast` times over the original context keep their
    frequency, those that turn fewer than `beta_slow` times are interpolated (divided by the
    factor), with a linear ramp between; attention logits are sharpened through cos and sin."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    else:
        attention = mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv = (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv.astype(np.float32), float(attention)


def _longrope_inv_freq(dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    """LongRoPE (Phi-3): frequency i divided by its own factor, from the long list when the
    engine's context exceeds the original one (`s.long_context`, fixed per engine: see
    RopeScaling), else the short list; cos and sin scaled by sqrt(1 + ln(factor) / ln(original))
    unless the config states the attention factor (or vLLM's short_mscale / long_mscale)."""
    ext = np.asarray(s.long_factor if s.long_context else s.short_factor, np.float64)
    assert ext.shape == (dim // 2,), (ext.shape, dim)  # ModelConfig checks the lengths
    inv = 1.0 / (ext * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    mscale = s.long_mscale if s.long_context else s.short_mscale
    if mscale is None:
        mscale = s.attention_factor
    if mscale is None:
        mscale = 1.0 if s.factor <= 1.0 else math.sqrt(
            1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))
    return inv.astype(np.float32), float(mscale)


class RotaryEmbedding(nnx.Module):
    """Rotate-half RoPE as in the Hugging Face Llama implementation, over the first
    `cfg.rotary_dim` dimensions of each head (all of them unless partial_rotary_factor < 1)."""

    def __init__(self, cfg: ModelConfig):
        # Config-derived constants, not parameters: plain Python values, so they are static.
        inv, scale = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_dim = cfg.rotary_dim
        self.inv_freq = tuple(float(f) for f in inv)
        self.scale = scale  # cos and sin are multiplied by it (yarn's and longrope's attention factor)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [T, heads, H], positions [T] -> x rotated."""
        inv = jnp.asarray(self.inv_freq, jnp.float32)
        freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]  # [T, H/2]
        cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        xf = x.astype(jnp.float32)
        rot, rest = xf[..., :self.rotary_dim], xf[..., self.rotary_dim:]  # rest: passed through (partial rotary)
        x1, x2 = jnp.split(rot, 2, axis=-1)
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin] + ([rest] if rest.shape[-1] else [])
        out = jnp.concatenate(parts, axis=-1)
        return out.astype(x.dtype)


class MLP(nnx.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)); SwiGLU with SiLU (Llama), GeGLU with the
    tanh GELU (Gemma): cfg.hidden_act. The projections may hold quantized weights (qeinsum)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        """cfg.fused_projections: gate and up as one [D, 2F] parameter (gate columns first), one
        matmul; split under tensor parallelism, whose column shards would mix the two."""
        d, f = cfg.hidden_size, cfg.intermediate_size
        init = nnx.initializers.normal(0.02)
        self.fused = cfg.fused_projections
        if self.fused:
            self.gate_up_proj = nnx.Param(init(rngs.params(), (d, 2 * f), dtype))  # D(F+F)
        else:
            self.gate_proj = nnx.Param(init(rngs.params(), (d, f), dtype))  # DF
            self.up_proj = nnx.Param(init(rngs.params(), (d, f), dtype))  # DF
        self.down_proj = nnx.Param(init(rngs.params(), (f, d), dtype))  # FD
        self.act = activation(cfg.hidden_act, cfg.architecture)
        self.act_name = cfg.hidden_act

    def input_weights(self) -> list:
        """The weights that read x (gate/up fused, or gate and up)."""
        return [self.gate_up_proj[...]] if self.fused else [self.gate_proj[...], self.up_proj[...]]

    def __call__(self, x: jax.Array | QuantizedRows, lora: LoRALayer | None = None) -> jax.Array:
        """x [T, D] (or its e4m3 rows, for fp8 weights) -> [T, D]; `lora`: the gate / up / down
        adapters' deltas are added (they need x itself)."""
        if self.fused:
            if lora is None:  # fp8 weights may take the activation fused with its quantization
                out = gated_mlp_fp8(x, self.gate_up_proj[...], self.down_proj[...], self.act_name)
                if out is not None:
                    return out
            gate, up = jnp.split(qeinsum("TD,DF->TF", x, self.gate_up_proj[...]), 2, axis=-1)
        else:
            gate = qeinsum("TD,DF->TF", x, self.gate_proj[...])
            up = qeinsum("TD,DF->TF", x, self.up_proj[...])
        if lora is not None:
            dg, du = lora.gate_up(x)
            gate, up = gate + dg, up + du
        h = self.act(gate) * up
        out = qeinsum("TF,FD->TD", h, self.down_proj[...])
        return out if lora is None else out + lora.down(h)


class BiasMLP(nnx.Module):
    """up -> activation -> down, both with biases (GPT-2, OPT)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        init = nnx.initializers.normal(0.02)
        self.up_proj = nnx.Param(init(rngs.params(), (d, f), dtype))  # DF
        self.up_bias = nnx.Param(jnp.zeros((f,), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (f, d), dtype))  # FD
        self.down_bias = nnx.Param(jnp.zeros((d,), dtype))
        self.act = activation(cfg.hidden_act, cfg.architecture)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.act(jnp.einsum("TD,DF->TF", x, self.up_proj[...]) + self.up_bias[...])
        return jnp.einsum("TF,FD->TD", h, self.down_proj[...]) + self.down_bias[...]
