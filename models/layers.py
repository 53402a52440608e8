"""Building blocks shared by every family: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models.config import ModelConfig, RopeScaling


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [H/2], with Llama 3.1 ("llama3") or linear scaling applied."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).astype(np.float32)
    # llama3: long wavelengths divided by factor, short kept, a smooth ramp between.
    low_wl = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wl = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wl = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wl - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = np.where(wl > low_wl, inv / scaling.factor, inv)
    mid = (wl <= low_wl) & (wl >= high_wl)
    scaled = np.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    return scaled.astype(np.float32)


class RotaryEmbedding(nnx.Module):
    """Rotate-half RoPE as in the Hugging Face Llama implementation."""

    def __init__(self, cfg: ModelConfig):
        # A config-derived constant, not a parameter: kept as a plain tuple so it is static.
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [T, heads, H], positions [T] -> x rotated."""
        inv = jnp.asarray(self.inv_freq, jnp.float32)
        freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]  # [T, H/2]
        cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
        xf = x.astype(jnp.float32)
        x1, x2 = jnp.split(xf, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

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

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fused:
            gate, up = jnp.split(jnp.einsum("TD,DF->TF", x, self.gate_up_proj[...]), 2, axis=-1)
        else:
            gate = jnp.einsum("TD,DF->TF", x, self.gate_proj[...])
            up = jnp.einsum("TD,DF->TF", x, self.up_proj[...])
        return jnp.einsum("TF,FD->TD", jax.nn.silu(gate) * up, self.down_proj[...])
