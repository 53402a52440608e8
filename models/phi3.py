"""Phi-3 (Abdin et al., 2024), Phi-3.5 and Phi-4-mini: Llama's decoder, built by models/llama.py.

    each layer:  h = h + attn(rmsnorm(h));  h = h + down(silu(gate(x)) * up(x)),  x = rmsnorm(h)

What differs is the checkpoint and the config, both handled here:
- the checkpoint stores q, k and v as one `qkv_proj` [(N + 2K) * H, D] and gate and up as one
  `gate_up_proj` [2F, D]; the table below splits them into the parts every family loads (the loader
  fuses them back where the model holds them fused, and leaves them apart under tensor parallelism);
- long-context models (Phi-3-mini-128k, Phi-3.5, Phi-4-mini) scale rotary frequencies by
  `longrope` ("su" in older configs): per-dimension short and long factor lists, the list chosen
  once per engine by its max_model_len (models/config.py, RopeScaling);
- Phi-4-mini rotates only the first 3/4 of each head (`partial_rotary_factor`);
- Phi-3-mini-4k attends within a sliding window of 2047 tokens, as transformers' Phi3 does with
  any `sliding_window` it is given (a window no shorter than max_position_embeddings changes
  nothing, and is dropped).

Legend: T tokens, D model, N query heads, K KV heads, H head dim, F ffn.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from jaxengine.models import llama
from jaxengine.models import weights as w
from jaxengine.models.config import ModelConfig

# transformers' Phi3Config accepts these rope types only ("su" and "yarn" are renamed longrope there;
# vLLM reads "yarn" as YaRN, so a Phi-3 config saying "yarn" is refused rather than guessed).
_ROPE_TYPES = ("default", "longrope", "su")


def config_from_hf(cfg: Mapping) -> ModelConfig:
    """Phi-3, Phi-3.5 and Phi-4-mini config.json -> ModelConfig."""
    arch = cfg["architectures"][0]
    rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    rs = cfg.get("rope_scaling") or rope_params or {}
    rtype = rs.get("rope_type") or rs.get("type") or "default"
    if rtype not in _ROPE_TYPES:
        raise ValueError(f"{arch}: rope_scaling type {rtype!r} is not supported (Phi-3 takes 'longrope', "
                         "also spelled 'su')")
    act = str(cfg.get("hidden_act", "silu"))
    if act not in ("silu", "swish"):
        raise ValueError(f"{arch}: hidden_act {act!r} is not supported (the gated MLP is SiLU)")
    base = llama.config_from_hf(cfg)  # no q/k/v bias, no q/k norm, no window: Phi-3 sets its own below
    sliding = cfg.get("sliding_window")
    return dataclasses.replace(
        base,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        sliding_window=int(sliding) if sliding and int(sliding) < int(cfg.get("max_position_embeddings", 4096))
        else None,
    )


# -- checkpoint names ---------------------------------------------------------------------------
def _qkv(part: int) -> w.Transform:
    """qkv_proj [(N + 2K) * H, D], rows q then k then v -> q [D, N, H] (part 0), or k / v
    [D, K * replicas, H] (parts 1, 2; each KV head repeated in place when replicated)."""
    def f(t: np.ndarray, c: ModelConfig) -> np.ndarray:
        q, kv = c.num_heads * c.head_dim, c.checkpoint_kv_heads * c.head_dim
        if t.ndim != 2 or t.shape[0] != q + 2 * kv:
            raise ValueError("qkv_proj rows are not (num_heads + 2 * num_kv_heads) * head_dim")
        rows = (t[:q], t[q:q + kv], t[q + kv:])[part]
        return w.heads_in("num_heads")(rows, c) if part == 0 else w.kv_heads_in(rows, c)
    return f


def _gate_up(part: int) -> w.Transform:
    """gate_up_proj [2F, D], gate rows first -> gate (part 0) or up (part 1) as [D, F]."""
    def f(t: np.ndarray, c: ModelConfig) -> np.ndarray:
        f_ = c.intermediate_size
        if t.ndim != 2 or t.shape[0] != 2 * f_:
            raise ValueError("gate_up_proj rows are not 2 * intermediate_size")
        return t[part * f_:(part + 1) * f_].T
    return f


_LAYER = r"model\.layers\.(\d+)\."
WEIGHTS: tuple[w.WeightRule, ...] = (
    w.rule(r"model\.embed_tokens\.weight", ("model", "embed_tokens"), w.same),
    w.rule(r"model\.norm\.weight", ("model", "norm", "weight"), w.same),
    w.rule(r"lm_head\.weight", ("lm_head",), w.transpose),
    w.rule(_LAYER + r"input_layernorm\.weight", ("input_layernorm", "weight"), w.same),
    w.rule(_LAYER + r"post_attention_layernorm\.weight", ("post_attention_layernorm", "weight"), w.same),
    w.WeightRule(_LAYER + r"self_attn\.qkv_proj\.weight", tuple(
        (("self_attn", name), _qkv(i)) for i, name in enumerate(("q_proj", "k_proj", "v_proj")))),
    w.rule(_LAYER + r"self_attn\.o_proj\.weight", ("self_attn", "o_proj"), w.o_proj),
    w.WeightRule(_LAYER + r"mlp\.gate_up_proj\.weight", tuple(
        (("mlp", name), _gate_up(i)) for i, name in enumerate(("gate_proj", "up_proj")))),
    w.rule(_LAYER + r"mlp\.down_proj\.weight", ("mlp", "down_proj"), w.transpose),
)
IGNORED = llama.IGNORED  # rotary_emb.inv_freq buffers, recomputed here
# The math is Llama's: RotaryEmbedding reads longrope and the partial rotary factor from the config.
ForCausalLM = llama.ForCausalLM
