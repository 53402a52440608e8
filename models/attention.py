"""Attention metadata (a registered pytree) and the model's attention layer.

Legend: T tokens, D model, N query heads, K KV heads, H head dim, S sequence slots, M max blocks per seq.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.config import ModelConfig
from jaxengine.models.layers import RMSNorm, RotaryEmbedding
from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_kv

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

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, attn_backend: str = "auto"):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = nnx.initializers.normal(0.02)
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
        self.attn_backend = attn_backend

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVCache,
                 md: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        q = jnp.einsum("TD,DNH->TNH", x, self.q_proj[...])
        k = jnp.einsum("TD,DKH->TKH", x, self.k_proj[...])
        v = jnp.einsum("TD,DKH->TKH", x, self.v_proj[...])
        if self.use_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, positions), self.rope(k, positions)
        k_cache, v_cache = write_kv(kv[0], kv[1], k, v, md.slot_mapping)
        o = ragged_paged_attention(
            q, k_cache, v_cache, md.kv_lens, md.block_tables, md.query_start_loc, md.num_seqs,
            sm_scale=self.sm_scale, sliding_window=self.sliding_window, backend=self.attn_backend)
        return jnp.einsum("TNH,NHD->TD", o, self.o_proj[...]), (k_cache, v_cache)
