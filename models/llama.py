"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3 (flags in ModelConfig).

Legend: T tokens, D model, V vocab. The forward takes the paged KV caches (one (k, v) pair per
layer) and returns them updated, so the compiled step can donate them. It also takes the engine's
attention backend (jaxengine.attention_backend), which every attention layer calls to write its
cache and attend: the model's construction depends on the config alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.attention import Attention, AttentionMetadata, KVCache
from jaxengine.models.config import ModelConfig
from jaxengine.models.layers import MLP, RMSNorm

if TYPE_CHECKING:
    from jaxengine.attention_backend import AttentionBackend


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVCache, md: AttentionMetadata,
                 attention: AttentionBackend) -> tuple[jax.Array, KVCache]:
        h, kv = self.self_attn(self.input_layernorm(x), positions, kv, md, attention)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Model(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))  # VD
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, attention: AttentionBackend) -> tuple[jax.Array, list[KVCache]]:
        x = self.embed_tokens[...][input_ids]  # [T, D]
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches):
            x, kv = layer(x, positions, kv, md, attention)
            new_caches.append(kv)
        return self.norm(x), new_caches


class ForCausalLM(nnx.Module):
    """A causal LM: `__call__` gives final hidden states, `compute_logits` the float32 logits."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Model(cfg, dtype, rngs)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))  # DV

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, attention: AttentionBackend) -> tuple[jax.Array, list[KVCache]]:
        """input_ids [T], positions [T] -> (hidden [T, D], the caches with this step's K/V written)."""
        return self.model(input_ids, positions, kv_caches, md, attention)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [R, D] -> logits [R, V] in float32."""
        if self.tie_word_embeddings:
            logits = jnp.einsum("RD,VD->RV", hidden, self.model.embed_tokens[...])
        else:
            logits = jnp.einsum("RD,DV->RV", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)
