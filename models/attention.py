"""Attention metadata (a registered pytree) and the model's attention layer.

The layer projects, normalises and rotates q/k/v; the paged-cache write and the attention itself
belong to the engine's attention backend (jaxengine.attention_backend), which the model receives
at call time.

Legend: T tokens, D model, N query heads, K KV heads, H head dim, S sequence slots, M max blocks per seq.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.config import ModelConfig
from jaxengine.models.layers import RMSNorm, RotaryEmbedding
from jaxengine.models.lora import LoRALayer
from jaxengine.models.quantization import QuantizedRows, QuantizedWeight, is_quantized, qeinsum

if TYPE_CHECKING:
    from jaxengine.attention_backend import AttentionBackend


KVCache = tuple[jax.Array, jax.Array]  # (k, v), each [num_blocks, K, block_size, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Fixed-shape description of one step's ragged batch; real counts are runtime values."""

    slot_mapping: jax.Array  # [T] int32 cache slot (block * block_size + offset) of each new token
    kv_lens: jax.Array  # [S] int32 context + new tokens per sequence; 0 for padded slots
    block_tables: jax.Array  # [S, M] int32 block ids, 0-padded
    query_start_loc: jax.Array  # [S + 1] int32 cumulative new-token counts
    num_seqs: jax.Array  # [1] int32 live sequences
    # [2] float32: an fp8 cache's (k_scale, v_scale) for the layer it is handed to
    # (AttentionBackend.layer_metadata); None: 1.0. A traced value, so every layer shares one trace.
    kv_scale: jax.Array | None = None


def init_qkv(layer: nnx.Module, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool) -> None:
    """The q/k/v (and o) projection parameters of an attention layer.

    cfg.fused_projections: q, k and v are one [D, N + 2K, H] parameter (and their biases one
    [N + 2K, H]), read by one matmul instead of three. Column shards of a fused weight would mix
    q, k and v, so under tensor parallelism the engine builds the model with them apart.
    """
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    init = nnx.initializers.normal(0.02)
    layer.fused_qkv = cfg.fused_projections
    layer.qkv_split = (n, n + k)  # head offsets of k and v in the fused weight
    layer.use_bias = bias
    if layer.fused_qkv:
        layer.qkv_proj = nnx.Param(init(rngs.params(), (d, n + 2 * k, h), dtype))  # D(N+K+K)H
    else:
        layer.q_proj = nnx.Param(init(rngs.params(), (d, n, h), dtype))  # DNH
        layer.k_proj = nnx.Param(init(rngs.params(), (d, k, h), dtype))  # DKH
        layer.v_proj = nnx.Param(init(rngs.params(), (d, k, h), dtype))  # DKH
    if bias:
        layer.q_bias = nnx.Param(jnp.zeros((n, h), dtype))
        layer.k_bias = nnx.Param(jnp.zeros((k, h), dtype))
        layer.v_bias = nnx.Param(jnp.zeros((k, h), dtype))
    layer.o_proj = nnx.Param(init(rngs.params(), (n, h, d), dtype))  # NHD


def qkv_weights(layer: nnx.Module) -> list:
    """The q/k/v projection weights `qkv` reads x with (one fused weight, or three)."""
    if layer.fused_qkv:
        return [layer.qkv_proj[...]]
    return [layer.q_proj[...], layer.k_proj[...], layer.v_proj[...]]


def qkv(layer: nnx.Module, x: jax.Array | QuantizedRows, lora: LoRALayer | None = None
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, D] (or its e4m3 rows for fp8 weights) -> q [T, N, H], k [T, K, H], v [T, K, H]
    (biases added; LoRA deltas with `lora`, which needs x itself)."""
    if layer.fused_qkv:
        fused = qeinsum("TD,DJH->TJH", x, layer.qkv_proj[...])  # J = N + 2K
        q, k, v = jnp.split(fused, layer.qkv_split, axis=1)
    else:
        q = qeinsum("TD,DNH->TNH", x, layer.q_proj[...])
        k = qeinsum("TD,DKH->TKH", x, layer.k_proj[...])
        v = qeinsum("TD,DKH->TKH", x, layer.v_proj[...])
    if layer.use_bias:
        q, k, v = q + layer.q_bias[...], k + layer.k_bias[...], v + layer.v_bias[...]
    if lora is not None:
        dq, dk, dv = lora.qkv(x)
        q, k, v = q + dq.reshape(q.shape), k + dk.reshape(k.shape), v + dv.reshape(v.shape)
    return q, k, v


def out_proj(o: jax.Array, w: jax.Array | QuantizedWeight, lora: LoRALayer | None = None) -> jax.Array:
    """o [T, N, H] @ o_proj [N, H, D] -> [T, D], as one [T, N*H] @ [N*H, D] matmul on row-major views
    (bitcasts): written as an einsum over (N, H), XLA on CPU transposed the weight and the
    activations to [H, N, ...] every step. A quantized o_proj runs its own matmul on the same view. `lora`: the o_proj adapters' delta is added."""
    t_, n, h = o.shape
    flat = o.reshape(t_, n * h)
    out = w.matmul(flat) if is_quantized(w) else flat @ w.reshape(n * h, w.shape[-1])
    return out if lora is None else out + lora.o(flat)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary positions (Llama/Mistral/Qwen2/Qwen3)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        h = cfg.head_dim
        init_qkv(self, cfg, dtype, rngs, bias=cfg.attention_bias)
        self.use_qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.norm_eps, dtype)
            self.k_norm = RMSNorm(h, cfg.norm_eps, dtype)
        self.rope = RotaryEmbedding(cfg)
        self.sm_scale = h ** -0.5
        self.sliding_window = cfg.sliding_window

    def __call__(self, x: jax.Array | QuantizedRows, positions: jax.Array, kv: KVCache, md: AttentionMetadata,
                 attention: AttentionBackend, lora: LoRALayer | None = None) -> tuple[jax.Array, KVCache]:
        """x [T, D] (or its e4m3 rows: `qkv`) -> ([T, D], this layer's cache with the step's K/V
        written)."""
        q, k, v = qkv(self, x, lora)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, positions), self.rope(k, positions)
        o, kv = attention.attend(q, k, v, kv, md, sm_scale=self.sm_scale, sliding_window=self.sliding_window)
        return out_proj(o, self.o_proj[...], lora), kv


class BiasAttention(nnx.Module):
    """Multi-head self-attention with biases on every projection and no rotary embedding (the
    positions are learned embeddings added to the input): GPT-2 and OPT."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, sm_scale: float):
        init_qkv(self, cfg, dtype, rngs, bias=True)
        self.o_bias = nnx.Param(jnp.zeros((cfg.hidden_size,), dtype))
        self.sm_scale = sm_scale

    def __call__(self, x: jax.Array, kv: KVCache, md: AttentionMetadata,
                 attention: AttentionBackend) -> tuple[jax.Array, KVCache]:
        """x [T, D] -> ([T, D], this layer's cache with the step's K/V written)."""
        q, k, v = qkv(self, x)
        o, kv = attention.attend(q, k, v, kv, md, sm_scale=self.sm_scale)
        return out_proj(o, self.o_proj[...]) + self.o_bias[...], kv
