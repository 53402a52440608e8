"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3 (flags in ModelConfig),
and by Phi-3, whose config parser and checkpoint table are models/phi3.py.

Legend: T tokens, D model, V vocab. The forward takes the paged KV caches (one (k, v) pair per
layer) and returns them updated, so the compiled step can donate them. It also takes the engine's
attention backend (jaxengine.attention_backend), which every attention layer calls to write its
cache and attend: the model's construction depends on the config alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models import weights as w
from jaxengine.models.attention import Attention, AttentionMetadata, KVCache, qkv_weights
from jaxengine.models.config import ModelConfig, hf_dtype, hf_eos_ids, hf_field, hf_rope, scaled_max_positions
from jaxengine.models.layer_call import call_layer
from jaxengine.models.layers import MLP, RMSNorm
from jaxengine.models.lora import LoRAInputs, LoRALayer

if TYPE_CHECKING:
    from jaxengine.attention_backend import AttentionBackend


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVCache, md: AttentionMetadata,
                 attention: AttentionBackend, lora: LoRALayer | None = None) -> tuple[jax.Array, KVCache]:
        # fp8 linears may take the norms' outputs as e4m3 rows (RMSNorm.into); LoRA needs them unquantized
        a_w, m_w = (qkv_weights(self.self_attn), self.mlp.input_weights()) if lora is None else ([], [])
        h, kv = self.self_attn(self.input_layernorm.into(x, a_w), positions, kv, md, attention, lora)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm.into(x, m_w), lora), kv


class Model(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, layer: type[nnx.Module] | None = None):
        """`layer(cfg, dtype, rngs, index)`: a family's own decoder layer (default: DecoderLayer)."""
        self.embed_tokens = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))  # VD
        self.layers = nnx.List([layer(cfg, dtype, rngs, i) if layer is not None else DecoderLayer(cfg, dtype, rngs)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, attention: AttentionBackend, lora: LoRAInputs | None = None
                 ) -> tuple[jax.Array, list[KVCache]]:
        x = self.embed_tokens[...][input_ids]  # [T, D]
        new_caches = []
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x, kv = call_layer(layer, x, positions, kv, attention.layer_metadata(md, i), attention,
                               None if lora is None else lora.layer(i), static=(4,))
            new_caches.append(kv)
        return self.norm(x), new_caches


class ForCausalLM(nnx.Module):
    """A causal LM: `__call__` gives final hidden states, `compute_logits` the float32 logits.
    A family with its own decoder layer (models/moe.py) subclasses it and sets `decoder_layer`."""

    decoder_layer: type[nnx.Module] | None = None  # (cfg, dtype, rngs, layer index); None: DecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Model(cfg, dtype, rngs, self.decoder_layer)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))  # DV

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, attention: AttentionBackend, lora: LoRAInputs | None = None
                 ) -> tuple[jax.Array, list[KVCache]]:
        """input_ids [T], positions [T] -> (hidden [T, D], the caches with this step's K/V written).
        `lora`: the step's LoRA adapters (models/lora.py), or None for the base model."""
        return self.model(input_ids, positions, kv_caches, md, attention, lora)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [R, D] -> logits [R, V] in float32."""
        if self.tie_word_embeddings:
            logits = jnp.einsum("RD,VD->RV", hidden, self.model.embed_tokens[...])
        else:
            logits = jnp.einsum("RD,DV->RV", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)


# -- config and checkpoint names ----------------------------------------------------------------
def config_from_hf(cfg: Mapping) -> ModelConfig:
    """Llama, Mistral, Qwen2 and Qwen3 config.json -> ModelConfig."""
    arch = cfg["architectures"][0]
    hidden, heads = int(hf_field(cfg, "hidden_size")), int(hf_field(cfg, "num_attention_heads"))
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    theta, scaling = hf_rope(cfg, arch, max_pos)
    rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    partial = cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0
    use_sw = cfg.get("use_sliding_window", arch.startswith("Mistral"))
    sliding = cfg.get("sliding_window") if use_sw else None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf_field(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(hf_field(cfg, "intermediate_size")),
        num_layers=int(hf_field(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=scaled_max_positions(max_pos, scaling),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch.startswith("Qwen2"))),
        qk_norm=arch.startswith("Qwen3"),
        sliding_window=int(sliding) if sliding else None,
        partial_rotary_factor=float(partial),
        torch_dtype=hf_dtype(cfg),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=hf_eos_ids(cfg),
    )


_LAYER = r"model\.layers\.(\d+)\."
WEIGHTS: tuple[w.WeightRule, ...] = (
    w.rule(r"model\.embed_tokens\.weight", ("model", "embed_tokens"), w.same),
    w.rule(r"model\.norm\.weight", ("model", "norm", "weight"), w.same),
    w.rule(r"lm_head\.weight", ("lm_head",), w.transpose),
    w.rule(_LAYER + r"input_layernorm\.weight", ("input_layernorm", "weight"), w.same),
    w.rule(_LAYER + r"post_attention_layernorm\.weight", ("post_attention_layernorm", "weight"), w.same),
    w.rule(_LAYER + r"self_attn\.q_proj\.weight", ("self_attn", "q_proj"), w.heads_in("num_heads")),
    w.rule(_LAYER + r"self_attn\.k_proj\.weight", ("self_attn", "k_proj"), w.kv_heads_in),
    w.rule(_LAYER + r"self_attn\.v_proj\.weight", ("self_attn", "v_proj"), w.kv_heads_in),
    w.rule(_LAYER + r"self_attn\.o_proj\.weight", ("self_attn", "o_proj"), w.o_proj),
    w.rule(_LAYER + r"self_attn\.q_proj\.bias", ("self_attn", "q_bias"), w.heads_bias("num_heads")),
    w.rule(_LAYER + r"self_attn\.k_proj\.bias", ("self_attn", "k_bias"), w.kv_heads_bias),
    w.rule(_LAYER + r"self_attn\.v_proj\.bias", ("self_attn", "v_bias"), w.kv_heads_bias),
    w.rule(_LAYER + r"self_attn\.q_norm\.weight", ("self_attn", "q_norm", "weight"), w.same),
    w.rule(_LAYER + r"self_attn\.k_norm\.weight", ("self_attn", "k_norm", "weight"), w.same),
    w.rule(_LAYER + r"mlp\.gate_proj\.weight", ("mlp", "gate_proj"), w.transpose),
    w.rule(_LAYER + r"mlp\.up_proj\.weight", ("mlp", "up_proj"), w.transpose),
    w.rule(_LAYER + r"mlp\.down_proj\.weight", ("mlp", "down_proj"), w.transpose),
)
IGNORED = r".*rotary_emb\.inv_freq"  # buffers some checkpoints carry, recomputed here
