"""OPT (Zhang et al., 2022): GPT-2's decoder with ReLU, learned positions offset by 2, and two
variations: `do_layer_norm_before=False` (OPT-350m) puts each LayerNorm after its residual add,
and `word_embed_proj_dim` smaller than the model width projects the embeddings in and out.

    h = project_in(embed[ids]) + positions_table[positions + 2]
    pre-LN block:   h = h + attn(ln_a(h));  h = h + mlp(ln_m(h));  final_layer_norm at the end
    post-LN block:  h = ln_a(h + attn(h));  h = ln_m(h + mlp(h))
    logits = project_out(h) @ embed^T

Legend: T tokens, D model, E word-embedding width, V vocab, P positions.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models import weights as w
from jaxengine.models.attention import AttentionMetadata, BiasAttention, KVCache
from jaxengine.models.config import ModelConfig, hf_dtype, hf_eos_ids, hf_field
from jaxengine.models.layer_call import call_layer
from jaxengine.models.layers import BiasMLP, LayerNorm, activation

if TYPE_CHECKING:
    from jaxengine.attention_backend import AttentionBackend

POSITION_OFFSET = 2  # OPT's learned position table starts 2 rows in (a quirk of its fairseq origin)


@dataclasses.dataclass(frozen=True)
class OPTConfig(ModelConfig):
    do_layer_norm_before: bool = True  # False: post-LayerNorm blocks, no final LayerNorm
    word_embed_proj_dim: int = 0  # E; equal to hidden_size: no projections


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: OPTConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.pre_norm = cfg.do_layer_norm_before
        self.self_attn_layer_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.self_attn = BiasAttention(cfg, dtype, rngs, cfg.head_dim ** -0.5)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.mlp = BiasMLP(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, kv: KVCache, md: AttentionMetadata,
                 attention: AttentionBackend) -> tuple[jax.Array, KVCache]:
        if self.pre_norm:
            h, kv = self.self_attn(self.self_attn_layer_norm(x), kv, md, attention)
            x = x + h
            return x + self.mlp(self.final_layer_norm(x)), kv
        h, kv = self.self_attn(x, kv, md, attention)
        x = self.self_attn_layer_norm(x + h)
        return self.final_layer_norm(x + self.mlp(x)), kv


class Model(nnx.Module):
    def __init__(self, cfg: OPTConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        d, e = cfg.hidden_size, cfg.word_embed_proj_dim
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, e), dtype))  # VE
        self.embed_positions = nnx.Param(
            init(rngs.params(), (cfg.max_position_embeddings + POSITION_OFFSET, d), dtype))  # PD
        self.projected = e != d
        if self.projected:
            self.project_in = nnx.Param(init(rngs.params(), (e, d), dtype))  # ED
            self.project_out = nnx.Param(init(rngs.params(), (d, e), dtype))  # DE
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = cfg.do_layer_norm_before
        if self.final_norm:
            self.norm = LayerNorm(d, cfg.norm_eps, dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, attention: AttentionBackend) -> tuple[jax.Array, list[KVCache]]:
        x = self.embed_tokens[...][input_ids]  # [T, E]
        if self.projected:
            x = jnp.einsum("TE,ED->TD", x, self.project_in[...])
        x = x + self.embed_positions[...][positions + POSITION_OFFSET]
        new_caches = []
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x, kv = call_layer(layer, x, kv, attention.layer_metadata(md, i), attention, static=(3,))
            new_caches.append(kv)
        if self.final_norm:
            x = self.norm(x)
        return x, new_caches


class OPTForCausalLM(nnx.Module):
    """`__call__` gives final hidden states (width D), `compute_logits` the float32 logits."""

    def __init__(self, cfg: OPTConfig, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Model(cfg, dtype, rngs)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (cfg.word_embed_proj_dim, cfg.vocab_size), dtype))  # EV

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, attention: AttentionBackend) -> tuple[jax.Array, list[KVCache]]:
        """input_ids [T], positions [T] -> (hidden [T, D], the caches with this step's K/V written)."""
        return self.model(input_ids, positions, kv_caches, md, attention)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [R, D] -> logits [R, V] in float32."""
        if self.model.projected:
            hidden = jnp.einsum("RD,DE->RE", hidden, self.model.project_out[...])
        if self.tie_word_embeddings:
            logits = jnp.einsum("RE,VE->RV", hidden, self.model.embed_tokens[...])
        else:
            logits = jnp.einsum("RE,EV->RV", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)


# -- config and checkpoint names ----------------------------------------------------------------
def config_from_hf(cfg: Mapping) -> OPTConfig:
    arch = cfg["architectures"][0]
    for name, supported in (("enable_bias", True), ("layer_norm_elementwise_affine", True),
                            ("_remove_final_layer_norm", False)):
        if name in cfg and bool(cfg[name]) != supported:
            raise ValueError(f"{arch}: {name}={cfg[name]!r} is not supported")
    hidden, heads = int(hf_field(cfg, "hidden_size")), int(hf_field(cfg, "num_attention_heads"))
    act = str(cfg.get("activation_function", "relu"))
    activation(act, arch)  # an unknown activation is refused here, by name
    return OPTConfig(
        architecture=arch,
        vocab_size=int(hf_field(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(hf_field(cfg, "ffn_dim")),
        num_layers=int(hf_field(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        norm_eps=1e-5,  # torch's LayerNorm default: OPT's configs carry no epsilon
        max_position_embeddings=int(hf_field(cfg, "max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        torch_dtype=hf_dtype(cfg),
        hidden_act=act,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=hf_eos_ids(cfg),
        do_layer_norm_before=bool(cfg.get("do_layer_norm_before", True)),
        word_embed_proj_dim=int(cfg.get("word_embed_proj_dim") or hidden),
    )


_P = r"(?:model\.)?decoder\."
_LAYER = _P + r"layers\.(\d+)\."
WEIGHTS: tuple[w.WeightRule, ...] = (
    w.rule(_P + r"embed_tokens\.weight", ("model", "embed_tokens"), w.same),
    w.rule(_P + r"embed_positions\.weight", ("model", "embed_positions"), w.same),
    w.rule(_P + r"project_in\.weight", ("model", "project_in"), w.transpose),
    w.rule(_P + r"project_out\.weight", ("model", "project_out"), w.transpose),
    w.rule(_P + r"final_layer_norm\.weight", ("model", "norm", "weight"), w.same),
    w.rule(_P + r"final_layer_norm\.bias", ("model", "norm", "bias"), w.same),
    w.rule(r"lm_head\.weight", ("lm_head",), w.transpose),
    w.rule(_LAYER + r"self_attn\.q_proj\.weight", ("self_attn", "q_proj"), w.heads_in("num_heads")),
    w.rule(_LAYER + r"self_attn\.k_proj\.weight", ("self_attn", "k_proj"), w.kv_heads_in),
    w.rule(_LAYER + r"self_attn\.v_proj\.weight", ("self_attn", "v_proj"), w.kv_heads_in),
    w.rule(_LAYER + r"self_attn\.q_proj\.bias", ("self_attn", "q_bias"), w.heads_bias("num_heads")),
    w.rule(_LAYER + r"self_attn\.k_proj\.bias", ("self_attn", "k_bias"), w.kv_heads_bias),
    w.rule(_LAYER + r"self_attn\.v_proj\.bias", ("self_attn", "v_bias"), w.kv_heads_bias),
    w.rule(_LAYER + r"self_attn\.out_proj\.weight", ("self_attn", "o_proj"), w.o_proj),
    w.rule(_LAYER + r"self_attn\.out_proj\.bias", ("self_attn", "o_bias"), w.same),
    w.rule(_LAYER + r"self_attn_layer_norm\.weight", ("self_attn_layer_norm", "weight"), w.same),
    w.rule(_LAYER + r"self_attn_layer_norm\.bias", ("self_attn_layer_norm", "bias"), w.same),
    w.rule(_LAYER + r"final_layer_norm\.weight", ("final_layer_norm", "weight"), w.same),
    w.rule(_LAYER + r"final_layer_norm\.bias", ("final_layer_norm", "bias"), w.same),
    w.rule(_LAYER + r"fc1\.weight", ("mlp", "up_proj"), w.transpose),
    w.rule(_LAYER + r"fc1\.bias", ("mlp", "up_bias"), w.same),
    w.rule(_LAYER + r"fc2\.weight", ("mlp", "down_proj"), w.transpose),
    w.rule(_LAYER + r"fc2\.bias", ("mlp", "down_bias"), w.same),
)
