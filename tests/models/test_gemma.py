"""Gemma 2 and Gemma 3 configs: the hub's config.json shapes (older files without `layer_types`,
Gemma 3's rope fields before and after transformers 5) read as transformers reads them, each
layer's window, rope and scale as the model builds it, and fields the engine does not implement
refused by name. Logits against transformers: tests/models/test_model.py ("gemma2", "gemma3")."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import transformers
from flax import nnx

from jaxengine.models import gemma
from jaxengine.models.config import ModelConfig
from jaxengine.models.presets import PRESETS

# google/gemma-3-1b-it's config.json (written by transformers 4.50: no layer_types, the old rope fields)
GEMMA3_1B = dict(
    architectures=["Gemma3ForCausalLM"], attention_bias=False, attn_logit_softcapping=None, bos_token_id=2,
    cache_implementation="hybrid", eos_token_id=[1, 106], final_logit_softcapping=None, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", hidden_size=1152, intermediate_size=6912,
    max_position_embeddings=32768, model_type="gemma3_text", num_attention_heads=4, num_hidden_layers=26,
    num_key_value_heads=1, pad_token_id=0, query_pre_attn_scalar=256, rms_norm_eps=1e-06,
    rope_local_base_freq=10000, rope_scaling=None, rope_theta=1000000, sliding_window=512,
    sliding_window_pattern=6, torch_dtype="bfloat16", vocab_size=262144)
# The text decoder of Gemma 3 4B: linear rope scaling (factor 8), on the global layers only.
GEMMA3_4B_TEXT = dict(GEMMA3_1B, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                      num_key_value_heads=4, num_hidden_layers=34, max_position_embeddings=131072,
                      sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0})


def _layers(cfg: gemma.GemmaConfig) -> list[tuple[int | None, tuple[float, ...]]]:
    """(window, inverse rope frequencies) of every attention layer of the built model."""
    model = nnx.eval_shape(lambda: gemma.ForCausalLM(cfg, jnp.bfloat16, rngs=nnx.Rngs(0)))
    return [(layer.self_attn.sliding_window, layer.self_attn.rope.inv_freq) for layer in model.model.layers]


def test_gemma2_9b_alternates_local_and_global_layers():
    """Gemma-2-9B's shape: even layers local (window 4096), odd global, as transformers' layer_types;
    both soft caps; scores scaled by query_pre_attn_scalar^-0.5; one rope everywhere."""
    cfg = ModelConfig.from_hf_dict(PRESETS["gemma-2-9b"])
    hf = transformers.Gemma2Config(**{k: v for k, v in PRESETS["gemma-2-9b"].items() if k != "architectures"})
    assert isinstance(cfg, gemma.GemmaConfig)
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.layer_types[:2] == (gemma.LOCAL, gemma.GLOBAL)
    assert (cfg.sliding_window, cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (4096, 50.0, 30.0)
    assert cfg.attention_soft_cap == 50.0 and cfg.eos_token_id == (1, 107) and cfg.tie_word_embeddings
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (42, 16, 8, 256)
    small = ModelConfig.from_hf_dict(dict(PRESETS["gemma-2-9b"], num_hidden_layers=2, vocab_size=64))
    (w0, rope0), (w1, rope1) = _layers(small)
    assert (w0, w1) == (4096, None) and rope0 == rope1


@pytest.mark.parametrize("hub", [GEMMA3_1B, GEMMA3_4B_TEXT], ids=["1b", "4b-text"])
def test_gemma3_hub_configs_read_as_transformers_reads_them(hub):
    """The 5:1 pattern from sliding_window_pattern, the local rope base, global-only scaling; the
    same config rewritten by transformers 5 (layer_types, per-kind rope_parameters) reads the same."""
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in hub.items() if k != "architectures"})
    cfg = ModelConfig.from_hf_dict(hub)
    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.layer_types[:6] == (gemma.LOCAL,) * 5 + (gemma.GLOBAL,)
    assert cfg.rope_theta == hf.rope_parameters[gemma.GLOBAL]["rope_theta"] == 1e6
    assert cfg.local_rope_theta == hf.rope_parameters[gemma.LOCAL]["rope_theta"] == 1e4
    assert cfg.local_rope_scaling is None
    scaled = hub["rope_scaling"] is not None
    assert (cfg.rope_scaling is not None) == scaled and cfg.max_position_embeddings == hub["max_position_embeddings"]
    assert cfg.qk_norm and cfg.attention_soft_cap is None and cfg.final_logit_softcapping is None
    assert cfg.query_pre_attn_scalar == 256 and cfg.eos_token_id == (1, 106)
    rewritten = dict(hf.to_dict(), architectures=["Gemma3ForCausalLM"])
    assert "rope_local_base_freq" not in rewritten and gemma.LOCAL in rewritten["rope_parameters"]
    assert ModelConfig.from_hf_dict(rewritten) == cfg


def test_gemma3_layers_get_their_window_and_rope():
    cfg = ModelConfig.from_hf_dict(dict(GEMMA3_4B_TEXT, num_hidden_layers=7, vocab_size=64))
    built = _layers(cfg)
    assert [w for w, _ in built] == [1024] * 5 + [None] + [1024]
    local, glob = built[0][1], built[5][1]
    assert local == built[6][1] and local != glob
    assert local[1] == pytest.approx(10000 ** (-2 / 256), rel=1e-6)  # base 1e4, unscaled
    assert glob[1] == pytest.approx(1e6 ** (-2 / 256) / 8, rel=1e-6)  # base 1e6, linear factor 8


@pytest.mark.parametrize("edit, match", [
    ({"use_bidirectional_attention": True}, "Gemma3ForCausalLM: use_bidirectional_attention=True is not supported"),
    ({"attention_bias": True}, "Gemma3ForCausalLM: attention_bias=True is not supported"),
    ({"tie_word_embeddings": False}, "Gemma3ForCausalLM: tie_word_embeddings=False is not supported"),
    ({"hidden_activation": "mish"}, "Gemma3ForCausalLM: activation 'mish' is not supported"),
    ({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "chunked_attention"]},
     "Gemma3ForCausalLM: layer_types must name"),
    ({"sliding_window": None}, "Gemma3ForCausalLM: config.json lacks 'sliding_window'"),
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "Gemma3ForCausalLM: rope_scaling type 'mrope'"),
])
def test_unsupported_fields_are_refused_by_name(edit, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**GEMMA3_1B, **edit})


def test_all_global_layers_need_no_window():
    cfg = ModelConfig.from_hf_dict({**GEMMA3_1B, "num_hidden_layers": 2, "sliding_window": None,
                                    "layer_types": ["full_attention"] * 2})
    assert cfg.sliding_window is None
