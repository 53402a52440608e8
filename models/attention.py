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


class Attention(nnx.Module):
    """Grouped-query self-attention over the paged KV cache (Llama/Mistral/Qwen2/Qwen3)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = nnx.initializers.normal(0.02)
        # cfg.fused_projections: q, k and v are one [D, N + 2K, H] parameter, read by one matmul
        # instead of three. Column shards of a fused weight would mix q, k and v, so under tensor
        # parallelism the engine builds the model with them apart.
        self.fused_qkv = cfg.fused_projections
        self.qkv_split = (n, n + k)  # head offsets of k and v in the fused weight
        if self.fused_qkv:
            self.qkv_proj = nnx.Param(init(rngs.params(), (d, n + 2 * k, h), dtype))  # D(N+K+K)H
        else:
            self.q_proj = nnx.Param(init(rngs.params(), (d, n, h), dtype))  # DNH
            self.k_proj = nnx.Param(init(rngs.params(), (d, k, h), dtype))  # DKH
            self.v_proj = nnx.Param(init(rngs.params(), (d, k, h), dtype))  # DKH
        self.o_proj = nnx.Param(init(rngs.params(), (n, h, d), dtype))  # NHD
        self.use_bias = cfg.attention_bias
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((n, h), dtype))
            self.k_bias = nnx.Param(jnp.zeros((k, h), dtype))
            self.v_bias = nnx.Param(jnp.zeros((k, h), dtype))
        self.use_qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.rope = RotaryEmbedding(cfg)
        self.sm_scale = h ** -0.5
        self.sliding_window = cfg.sliding_window

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVCache, md: AttentionMetadata,
                 attention: AttentionBackend) -> tuple[jax.Array, KVCache]:
        """x [T, D] -> ([T, D], this layer's cache with the step's K/V written)."""
        if self.fused_qkv:
            qkv = jnp.einsum("TD,DJH->TJH", x, self.qkv_proj[...])  # J = N + 2K
            q, k, v = jnp.split(qkv, self.qkv_split, axis=1)
        else:
            q = jnp.einsum("TD,DNH->TNH", x, self.q_proj[...])
            k = jnp.einsum("TD,DKH->TKH", x, self.k_proj[...])
            v = jnp.einsum("TD,DKH->TKH", x, self.v_proj[...])
        if self.use_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, positions), self.rope(k, positions)
        o, kv = attention.attend(q, k, v, kv, md, sm_scale=self.sm_scale, sliding_window=self.sliding_window)
        # One [T, N*H] @ [N*H, D] matmul on row-major views (bitcasts): written as an einsum over
        # (N, H), XLA on CPU transposed the weight and the activations to [H, N, ...] every step.
        t_, n, h = o.shape
        w = self.o_proj[...]
        return o.reshape(t_, n * h) @ w.reshape(n * h, w.shape[-1]), kv
