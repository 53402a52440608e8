"""GPT-2 (Radford et al., 2019): learned absolute positions, pre-LayerNorm blocks, a GELU MLP,
biases on every projection, the LM head tied to the token embedding.

    h = wte[ids] + wpe[positions]
    each block:  h = h + attn(ln_1(h));  h = h + mlp(ln_2(h))
    logits = ln_f(h) @ wte^T

Legend: T tokens, D model, V vocab, P positions. The checkpoint stores its projections as Conv1D
weights ([in, out]) with q, k and v in one `c_attn`; the table at the bottom maps them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models import weights as w
from jaxengine.models.attention import AttentionMetadata, BiasAttention, KVCache
from jaxengine.models.config import ModelConfig, hf_dtype, hf_eos_ids, hf_field
from jaxengine.models.layer_call import call_layer
from jaxengine.models.layers import BiasMLP, LayerNorm, activation

if TYPE_CHECKING:
    from jaxengine.attention_backend import AttentionBackend


@dataclasses.dataclass(frozen=True)
class GPT2Config(ModelConfig):
    scale_attn_weights: bool = True  # scores divided by sqrt(head_dim)
    scale_attn_by_inverse_layer_idx: bool = False  # layer i's scores further divided by i + 1


class Block(nnx.Module):
    def __init__(self, cfg: GPT2Config, layer: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        scale = cfg.head_dim ** -0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.attn = BiasAttention(cfg, dtype, rngs, scale)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.mlp = BiasMLP(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, kv: KVCache, md: AttentionMetadata,
                 attention: AttentionBackend) -> tuple[jax.Array, KVCache]:
        h, kv = self.attn(self.ln_1(x), kv, md, attention)
        x = x + h
        return x + self.mlp(self.ln_2(x)), kv


class Model(nnx.Module):
    def __init__(self, cfg: GPT2Config, dtype: jnp.dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))  # VD
        self.embed_positions = nnx.Param(
            init(rngs.params(), (cfg.max_position_embeddings, cfg.hidden_size), dtype))  # PD
        self.layers = nnx.List([Block(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, attention: AttentionBackend) -> tuple[jax.Array, list[KVCache]]:
        x = self.embed_tokens[...][input_ids] + self.embed_positions[...][positions]  # [T, D]
        new_caches = []
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x, kv = call_layer(layer, x, kv, attention.layer_metadata(md, i), attention, static=(3,))
            new_caches.append(kv)
        return self.norm(x), new_caches


class GPT2LMHeadModel(nnx.Module):
    """`__call__` gives final hidden states, `compute_logits` the float32 logits."""

    def __init__(self, cfg: GPT2Config, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
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


# -- config and checkpoint names ----------------------------------------------------------------
def config_from_hf(cfg: Mapping) -> GPT2Config:
    arch = cfg["architectures"][0]
    if cfg.get("add_cross_attention"):
        raise ValueError(f"{arch}: add_cross_attention=True (an encoder-decoder) is not supported")
    hidden, heads = int(hf_field(cfg, "n_embd")), int(hf_field(cfg, "n_head"))
    act = str(cfg.get("activation_function", "gelu_new"))
    activation(act, arch)  # an unknown activation is refused here, by name
    return GPT2Config(
        architecture=arch,
        vocab_size=int(hf_field(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("n_inner") or 4 * hidden),
        num_layers=int(hf_field(cfg, "n_layer")),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(hf_field(cfg, "n_positions")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        torch_dtype=hf_dtype(cfg),
        hidden_act=act,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=hf_eos_ids(cfg),
        scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(cfg.get("scale_attn_by_inverse_layer_idx", False)),
    )


def _c_attn(part: int, bias: bool) -> w.Transform:
    """Conv1D c_attn [D, 3D] (bias [3D]): q, k, v side by side -> part `part` as [D, heads, H]
    (bias [heads, H]); k and v repeated in place when KV heads are replicated."""
    def f(t: np.ndarray, c: ModelConfig) -> np.ndarray:
        d, heads = c.hidden_size, c.num_heads if part == 0 else c.checkpoint_kv_heads
        x = t[..., part * d:(part + 1) * d]
        x = x.reshape(heads, c.head_dim) if bias else x.reshape(d, heads, c.head_dim)
        if part and c.kv_head_replicas > 1:
            x = np.repeat(x, c.kv_head_replicas, axis=-2)
        return x
    return f


def _c_proj(t: np.ndarray, c: ModelConfig) -> np.ndarray:
    """Conv1D attn.c_proj [N*H, D] -> ours [N, H, D]."""
    return t.reshape(c.num_heads, c.head_dim, c.hidden_size)


_P = r"(?:transformer\.)?"  # the hub's original files name tensors without the prefix
_LAYER = _P + r"h\.(\d+)\."
WEIGHTS: tuple[w.WeightRule, ...] = (
    w.rule(_P + r"wte\.weight", ("model", "embed_tokens"), w.same),
    w.rule(_P + r"wpe\.weight", ("model", "embed_positions"), w.same),
    w.rule(_P + r"ln_f\.weight", ("model", "norm", "weight"), w.same),
    w.rule(_P + r"ln_f\.bias", ("model", "norm", "bias"), w.same),
    w.rule(r"lm_head\.weight", ("lm_head",), w.transpose),
    w.rule(_LAYER + r"ln_1\.weight", ("ln_1", "weight"), w.same),
    w.rule(_LAYER + r"ln_1\.bias", ("ln_1", "bias"), w.same),
    w.rule(_LAYER + r"ln_2\.weight", ("ln_2", "weight"), w.same),
    w.rule(_LAYER + r"ln_2\.bias", ("ln_2", "bias"), w.same),
    w.WeightRule(_LAYER + r"attn\.c_attn\.weight", tuple(
        (("attn", name), _c_attn(i, bias=False)) for i, name in enumerate(("q_proj", "k_proj", "v_proj")))),
    w.WeightRule(_LAYER + r"attn\.c_attn\.bias", tuple(
        (("attn", name), _c_attn(i, bias=True)) for i, name in enumerate(("q_bias", "k_bias", "v_bias")))),
    w.rule(_LAYER + r"attn\.c_proj\.weight", ("attn", "o_proj"), _c_proj),
    w.rule(_LAYER + r"attn\.c_proj\.bias", ("attn", "o_bias"), w.same),
    w.rule(_LAYER + r"mlp\.c_fc\.weight", ("mlp", "up_proj"), w.same),  # Conv1D: already [in, out]
    w.rule(_LAYER + r"mlp\.c_fc\.bias", ("mlp", "up_bias"), w.same),
    w.rule(_LAYER + r"mlp\.c_proj\.weight", ("mlp", "down_proj"), w.same),
    w.rule(_LAYER + r"mlp\.c_proj\.bias", ("mlp", "down_bias"), w.same),
)
# The causal-mask buffers older checkpoints carry.
IGNORED = _LAYER + r"attn\.(?:masked_)?bias"
