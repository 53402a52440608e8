"""Gemma 2 (Gemma Team, 2024) and Gemma 3's text decoder (Gemma Team, 2025).

    h = embed[ids] * sqrt(D)                                  (the scale rounded to the model dtype)
    each layer:  h = h + post_attn_norm(attn(input_norm(h)))
                 h = h + post_ffw_norm(mlp(pre_ffw_norm(h)))   mlp: down(gelu_tanh(gate(x)) * up(x))
    logits = c * tanh((norm(h) @ embed^T) / c)                c = final_logit_softcapping, if set

Every RMSNorm scales by (1 + weight), so a zero weight is the identity. Attention scores are
scaled by query_pre_attn_scalar^-0.5 (not head_dim^-0.5). Layers alternate between local
attention over a sliding window and global attention (`layer_types`):

  Gemma 2: even layers local, odd layers global; scores soft-capped, c * tanh(s / c) with
           c = attn_logit_softcapping; one rope for every layer.
  Gemma 3: five local layers to each global one; RMSNorm on q and k per head instead of the
           score cap; local layers rotate with base rope_local_base_freq, global layers with
           rope_theta (and the config's rope scaling, global layers only).

A layer's window and rope are fixed when the model is built (plain attributes, static under jit).
A window W keeps the W most recent positions, the token's own included (key position > query
position - W): transformers' `sliding_window_overlay` and the attention kernels' contract agree,
so the config's value is passed on as it is.

Legend: T tokens, D model, V vocab. The checkpoint names are Llama's plus the two feed-forward
norms and (Gemma 3) q_norm / k_norm; the table is at the bottom.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models import layers
from jaxengine.models import weights as w
from jaxengine.models.attention import AttentionMetadata, KVCache, init_qkv, out_proj, qkv
from jaxengine.models.config import ModelConfig, RopeScaling, hf_dtype, hf_eos_ids, hf_field, hf_rope
from jaxengine.models.layer_call import call_layer
from jaxengine.models.layers import RotaryEmbedding, activation

if TYPE_CHECKING:
    from jaxengine.attention_backend import AttentionBackend

LOCAL, GLOBAL = "sliding_attention", "full_attention"  # transformers' names of the two layer kinds


@dataclasses.dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """`sliding_window` is the local layers' window (None when no layer is local); `rope_theta`
    and `rope_scaling` are the global layers' rope."""

    query_pre_attn_scalar: float = 256.0  # scores scaled by its inverse square root
    attn_logit_softcapping: float | None = None  # c of c * tanh(score / c) (Gemma 2)
    final_logit_softcapping: float | None = None  # c of c * tanh(logit / c)
    layer_types: tuple[str, ...] = ()  # per layer: LOCAL or GLOBAL
    local_rope_theta: float = 10000.0  # the local layers' rope base
    local_rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {LOCAL, GLOBAL}:
            raise ValueError(f"{self.architecture}: layer_types must name {LOCAL!r} or {GLOBAL!r} for each of "
                             f"the {self.num_layers} layers, got {list(self.layer_types)}")
        if (LOCAL in self.layer_types) != (self.sliding_window is not None):
            raise ValueError(f"{self.architecture}: sliding_window={self.sliding_window} with layer_types "
                             f"{list(self.layer_types)}")

    @property
    def attention_soft_cap(self) -> float | None:
        return self.attn_logit_softcapping

    @property
    def kv_window(self) -> int | None:
        return self.sliding_window if GLOBAL not in self.layer_types else None

    def layer_rope(self, layer: int) -> ModelConfig:
        """The config whose rope fields are layer `layer`'s rope (what RotaryEmbedding reads)."""
        if self.layer_types[layer] == GLOBAL:
            return self
        return dataclasses.replace(self, rope_theta=self.local_rope_theta, rope_scaling=self.local_rope_scaling)

    def num_params(self) -> int:
        extra_norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return super().num_params() + self.num_layers * extra_norms


class RMSNorm(layers.RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), in float32, cast back once at the end."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        super().__init__(dim, eps, dtype)
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention of one layer: its window (local layers), its rope, Gemma's scale."""

    def __init__(self, cfg: GemmaConfig, layer: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        init_qkv(self, cfg, dtype, rngs, bias=False)
        self.use_qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype)
        self.rope = RotaryEmbedding(cfg.layer_rope(layer))
        self.sm_scale = cfg.query_pre_attn_scalar ** -0.5
        self.soft_cap = cfg.attn_logit_softcapping
        self.sliding_window = cfg.sliding_window if cfg.layer_types[layer] == LOCAL else None

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVCache, md: AttentionMetadata,
                 attention: AttentionBackend) -> tuple[jax.Array, KVCache]:
        """x [T, D] -> ([T, D], this layer's cache with the step's K/V written)."""
        q, k, v = qkv(self, x)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, positions), self.rope(k, positions)
        o, kv = attention.attend(q, k, v, kv, md, sm_scale=self.sm_scale, sliding_window=self.sliding_window,
                                 soft_cap=self.soft_cap)
        return out_proj(o, self.o_proj[...]), kv


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: GemmaConfig, layer: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, eps = cfg.hidden_size, cfg.norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.self_attn = Attention(cfg, layer, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, dtype)
        self.mlp = layers.MLP(cfg, dtype, rngs)  # GeGLU: cfg.hidden_act is the tanh GELU
        self.post_feedforward_layernorm = RMSNorm(d, eps, dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVCache, md: AttentionMetadata,
                 attention: AttentionBackend) -> tuple[jax.Array, KVCache]:
        h, kv = self.self_attn(self.input_layernorm(x), positions, kv, md, attention)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), kv


class Model(nnx.Module):
    def __init__(self, cfg: GemmaConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))  # VD
        # transformers multiplies by sqrt(D) cast to the weights' dtype (55.4256 is 55.5 in bfloat16).
        self.normalizer = math.sqrt(cfg.hidden_size)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, attention: AttentionBackend) -> tuple[jax.Array, list[KVCache]]:
        embed = self.embed_tokens[...]
        x = embed[input_ids] * jnp.asarray(self.normalizer, embed.dtype)  # [T, D]
        new_caches = []
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x, kv = call_layer(layer, x, positions, kv, attention.layer_metadata(md, i), attention, static=(4,))
            new_caches.append(kv)
        return self.norm(x), new_caches


class ForCausalLM(nnx.Module):
    """`__call__` gives final hidden states, `compute_logits` the float32 (soft-capped) logits.
    The LM head is the token embedding."""

    def __init__(self, cfg: GemmaConfig, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Model(cfg, dtype, rngs)
        self.final_soft_cap = cfg.final_logit_softcapping

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, attention: AttentionBackend) -> tuple[jax.Array, list[KVCache]]:
        """input_ids [T], positions [T] -> (hidden [T, D], the caches with this step's K/V written)."""
        return self.model(input_ids, positions, kv_caches, md, attention)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [R, D] -> logits [R, V] in float32."""
        logits = jnp.einsum("RD,VD->RV", hidden, self.model.embed_tokens[...]).astype(jnp.float32)
        if self.final_soft_cap is not None:
            logits = self.final_soft_cap * jnp.tanh(logits / self.final_soft_cap)
        return logits


# -- config and checkpoint names ----------------------------------------------------------------
def _layer_types(cfg: Mapping, arch: str, num_layers: int) -> tuple[str, ...]:
    """`layer_types`, or the pattern older configs imply: Gemma 2 alternates local and global
    (even layers local), Gemma 3 makes every `sliding_window_pattern`-th layer global (6)."""
    if cfg.get("layer_types"):
        return tuple(str(t) for t in cfg["layer_types"])
    period = 2 if arch.startswith("Gemma2") else int(cfg.get("sliding_window_pattern") or 6)
    return tuple(LOCAL if (i + 1) % period else GLOBAL for i in range(num_layers))


def _ropes(cfg: Mapping, arch: str, max_pos: int) -> tuple[tuple[float, RopeScaling | None],
                                                             tuple[float, RopeScaling | None]]:
    """((global theta, scaling), (local theta, scaling)). Gemma 2 has one rope; Gemma 3 configs
    state rope_theta / rope_scaling (global) and rope_local_base_freq, or, as transformers 5
    writes them, `rope_parameters` per layer kind."""
    if arch.startswith("Gemma2"):
        rope = hf_rope(cfg, arch, max_pos)
        return rope, rope
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, Mapping) and (GLOBAL in params or LOCAL in params):
        def kind(name: str, default_theta: float) -> tuple[float, RopeScaling | None]:
            return hf_rope({"rope_parameters": {"rope_theta": default_theta, **(params.get(name) or {})}},
                           arch, max_pos)
        return kind(GLOBAL, 1_000_000.0), kind(LOCAL, 10_000.0)
    theta, scaling = hf_rope({**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)}, arch, max_pos)
    return (theta, scaling), (float(cfg.get("rope_local_base_freq", 10_000.0)), None)


def config_from_hf(cfg: Mapping) -> GemmaConfig:
    """Gemma2ForCausalLM and Gemma3ForCausalLM (model_type gemma3_text) config.json -> GemmaConfig."""
    arch = cfg["architectures"][0]
    gemma3 = arch.startswith("Gemma3")
    for name, supported in (("attention_bias", False), ("use_bidirectional_attention", False),
                            ("tie_word_embeddings", True)):
        if cfg.get(name) is not None and bool(cfg[name]) != supported:
            raise ValueError(f"{arch}: {name}={cfg[name]!r} is not supported")
    hidden, heads = int(hf_field(cfg, "hidden_size")), int(hf_field(cfg, "num_attention_heads"))
    num_layers = int(hf_field(cfg, "num_hidden_layers"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
    activation(act, arch)  # an unknown activation is refused here, by name
    types = _layer_types(cfg, arch, num_layers)
    sliding = int(hf_field(cfg, "sliding_window")) if LOCAL in types else None
    max_pos = int(cfg.get("max_position_embeddings", 8192))
    (theta, scaling), (local_theta, local_scaling) = _ropes(cfg, arch, max_pos)
    caps = {k: float(cfg[k]) if cfg.get(k) is not None else None
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return GemmaConfig(
        architecture=arch,
        vocab_size=int(hf_field(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(hf_field(cfg, "intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        # Gemma 3's max_position_embeddings already is the long context its global rope scaling
        # serves (131072 with factor 8): not stretched again.
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        qk_norm=gemma3,
        sliding_window=sliding,
        torch_dtype=hf_dtype(cfg),
        hidden_act=act,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=hf_eos_ids(cfg),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        # transformers' Gemma 3 attention never applies attn_logit_softcapping (its configs set none).
        attn_logit_softcapping=None if gemma3 else caps["attn_logit_softcapping"],
        final_logit_softcapping=caps["final_logit_softcapping"],
        layer_types=types,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


_LAYER = r"model\.layers\.(\d+)\."
WEIGHTS: tuple[w.WeightRule, ...] = (
    w.rule(r"model\.embed_tokens\.weight", ("model", "embed_tokens"), w.same),
    w.rule(r"model\.norm\.weight", ("model", "norm", "weight"), w.same),
    *(w.rule(_LAYER + name + r"\.weight", (name, "weight"), w.same)
      for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")),
    w.rule(_LAYER + r"self_attn\.q_proj\.weight", ("self_attn", "q_proj"), w.heads_in("num_heads")),
    w.rule(_LAYER + r"self_attn\.k_proj\.weight", ("self_attn", "k_proj"), w.kv_heads_in),
    w.rule(_LAYER + r"self_attn\.v_proj\.weight", ("self_attn", "v_proj"), w.kv_heads_in),
    w.rule(_LAYER + r"self_attn\.o_proj\.weight", ("self_attn", "o_proj"), w.o_proj),
    w.rule(_LAYER + r"self_attn\.q_norm\.weight", ("self_attn", "q_norm", "weight"), w.same),
    w.rule(_LAYER + r"self_attn\.k_norm\.weight", ("self_attn", "k_norm", "weight"), w.same),
    w.rule(_LAYER + r"mlp\.gate_proj\.weight", ("mlp", "gate_proj"), w.transpose),
    w.rule(_LAYER + r"mlp\.up_proj\.weight", ("mlp", "up_proj"), w.transpose),
    w.rule(_LAYER + r"mlp\.down_proj\.weight", ("mlp", "down_proj"), w.transpose),
)
