"""Rope scaling against transformers' own frequency functions, and the context it derives.

yarn and linear equal transformers exactly. dynamic follows vLLM: the NTK-scaled base is
computed once, for the scaled maximum length, which is transformers' dynamic formula evaluated
at that length (transformers itself rescales as a sequence grows past the trained context).
longrope follows vLLM too: its factor list is chosen once, by the engine's max_model_len, which is
transformers' choice for a sequence of that length (tests/models/test_phi3.py checks the logits).
Logits of a yarn model against transformers run with the other families in test_model.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxengine.models.config import ModelConfig
from jaxengine.models.layers import rope_inv_freq

BASE = dict(architectures=["Qwen2ForCausalLM"], vocab_size=1000, hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1_000_000.0,
            max_position_embeddings=32768)


def _hf(rope_scaling: dict, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    cfg = transformers.Qwen2Config(**{k: v for k, v in BASE.items() if k != "architectures"},
                                   rope_scaling=rope_scaling)
    kind = rope_scaling.get("rope_type") or rope_scaling["type"]
    inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)
    return inv.numpy(), float(factor)


def _ours(rope_scaling: dict) -> tuple[ModelConfig, np.ndarray, float]:
    cfg = ModelConfig.from_hf_dict({**BASE, "rope_scaling": rope_scaling})
    inv, factor = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return cfg, inv, factor


@pytest.mark.parametrize("rope_scaling", [
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5-7B-Instruct's
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
     "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16384, "attention_factor": 1.3,
     "truncate": False},
])
def test_yarn_equals_transformers(rope_scaling: dict) -> None:
    want_inv, want_factor = _hf(rope_scaling)
    cfg, inv, factor = _ours(rope_scaling)
    np.testing.assert_allclose(inv, want_inv, rtol=1e-6)
    assert factor == pytest.approx(want_factor, rel=1e-9)
    # the context it serves: the original length times the factor (as vLLM derives it)
    assert cfg.max_position_embeddings == max(32768, int(rope_scaling["original_max_position_embeddings"]
                                                         * rope_scaling["factor"]))


def test_linear_equals_transformers() -> None:
    want_inv, _ = _hf({"rope_type": "linear", "factor": 2.0})
    cfg, inv, factor = _ours({"rope_type": "linear", "factor": 2.0})
    np.testing.assert_allclose(inv, want_inv, rtol=1e-6)
    assert factor == 1.0 and cfg.max_position_embeddings == 65536


def test_dynamic_is_transformers_at_the_scaled_length() -> None:
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    cfg, inv, factor = _ours(scaling)
    want_inv, _ = _hf(scaling, seq_len=2 * 32768)
    np.testing.assert_allclose(inv, want_inv, rtol=1e-6)
    unscaled, _ = _hf(scaling)  # transformers within the trained context: no scaling yet
    assert not np.allclose(inv, unscaled) and factor == 1.0
    assert cfg.max_position_embeddings == 65536


def test_llama3_keeps_the_stated_context() -> None:
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 131072,
                                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192}})
    assert cfg.max_position_embeddings == 131072


# -- longrope (Phi-3) --------------------------------------------------------------------------
# Phi-3-mini-128k's context over its original 4096; head_dim 64 (32 factors a list, 24 when 3/4 rotate)
PHI3 = dict(architectures=["Phi3ForCausalLM"], vocab_size=1000, hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0,
            max_position_embeddings=131072, original_max_position_embeddings=4096)


def _longrope(n: int, **extra) -> dict:
    return dict(type="longrope", short_factor=list(np.linspace(1.0, 2.5, n)),
                long_factor=list(np.geomspace(1.0, 64.0, n)), **extra)


def _hf_longrope(partial: float, rope_scaling: dict, seq_len: int | None) -> tuple[np.ndarray, float]:
    cfg = transformers.Phi3Config(**{k: v for k, v in PHI3.items() if k != "architectures"},
                                  partial_rotary_factor=partial, rope_scaling={**rope_scaling, "type": "longrope"})
    inv, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)
    return inv.numpy(), float(factor)


@pytest.mark.parametrize("spelling", ["longrope", "su"])
@pytest.mark.parametrize("partial", [1.0, 0.75])  # Phi-3.5-mini; Phi-4-mini rotates 3/4 of each head
def test_longrope_equals_transformers(spelling: str, partial: float) -> None:
    """Short factors for an engine within the original context (transformers' choice for any
    sequence that fits it), long factors for a longer one (transformers' choice for a sequence past
    it); the attention factor sqrt(1 + ln(131072 / 4096) / ln(4096)) either way."""
    scaling = _longrope(int(64 * partial) // 2)
    cfg = ModelConfig.from_hf_dict({**PHI3, "partial_rotary_factor": partial,
                                    "rope_scaling": {**scaling, "type": spelling}})
    assert cfg.rotary_dim == int(64 * partial) and cfg.rope_scaling.rope_type == "longrope"
    # the config's context is already the long one (no factor applied), served by default up to the original
    assert cfg.max_position_embeddings == 131072 and cfg.default_max_model_len == 4096
    for max_model_len, seq_len in ((4096, None), (4096, 4096), (4097, 4097), (131072, 131072)):
        inv, factor = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.with_max_model_len(max_model_len).rope_scaling)
        want_inv, want_factor = _hf_longrope(partial, scaling, seq_len)
        np.testing.assert_allclose(inv, want_inv, rtol=1e-6)
        assert factor == pytest.approx(want_factor, rel=1e-9)
        assert factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-12)


def test_longrope_stated_attention_factor_and_mscales() -> None:
    """A stated `attention_factor` (or `factor`) is used as transformers uses it; vLLM's
    `short_mscale` / `long_mscale` (Phi-3.5-MoE's configs) take precedence for their list."""
    scaling = _longrope(32, attention_factor=1.25)
    cfg = ModelConfig.from_hf_dict({**PHI3, "rope_scaling": scaling})
    _, factor = rope_inv_freq(64, cfg.rope_theta, cfg.rope_scaling)
    assert factor == 1.25 == _hf_longrope(1.0, scaling, None)[1]
    scaling = _longrope(32, factor=8.0)
    cfg = ModelConfig.from_hf_dict({**PHI3, "rope_scaling": scaling})
    _, factor = rope_inv_freq(64, cfg.rope_theta, cfg.rope_scaling)
    assert factor == pytest.approx(_hf_longrope(1.0, scaling, None)[1], rel=1e-12)
    assert factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(4096)), rel=1e-12)
    cfg = ModelConfig.from_hf_dict({**PHI3, "rope_scaling": _longrope(32, short_mscale=1.1, long_mscale=1.3)})
    assert rope_inv_freq(64, 1e4, cfg.rope_scaling)[1] == 1.1
    assert rope_inv_freq(64, 1e4, cfg.with_max_model_len(8192).rope_scaling)[1] == 1.3


def test_longrope_original_context_at_the_top_of_the_config_wins() -> None:
    """Phi-3 configs state original_max_position_embeddings beside max_position_embeddings; as in
    transformers it overrides one inside the rope entry, and is required."""
    cfg = ModelConfig.from_hf_dict({**PHI3, "rope_scaling": _longrope(32, original_max_position_embeddings=2048)})
    assert cfg.rope_scaling.original_max_position_embeddings == 4096
    with pytest.raises(ValueError, match="Phi3ForCausalLM: rope_scaling of type 'longrope' needs "
                                         "'original_max_position_embeddings'"):
        ModelConfig.from_hf_dict({**{k: v for k, v in PHI3.items() if k != "original_max_position_embeddings"},
                                  "rope_scaling": _longrope(32)})


@pytest.mark.parametrize("rope_scaling, match", [
    ({"type": "mrope", "mrope_section": [16, 24, 24]}, "rope_scaling type 'mrope' is not supported"),
    ({"rope_type": "longrope", "factor": 4.0}, "type 'longrope' needs 'short_factor'"),
    ({"rope_type": "yarn"}, "needs a 'factor'"),
])
def test_unsupported_or_incomplete_scaling_is_refused(rope_scaling: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": rope_scaling})
