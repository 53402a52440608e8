"""Rope scaling against transformers' own frequency functions, and the context it derives.

yarn and linear equal transformers exactly. dynamic follows vLLM: the NTK-scaled base is
computed once, for the scaled maximum length, which is transformers' dynamic formula evaluated
at that length (transformers itself rescales as a sequence grows past the trained context).
Logits of a yarn model against transformers run with the other families in test_model.py.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("rope_scaling, match", [
    ({"rope_type": "longrope", "factor": 4.0}, "rope_scaling type 'longrope' is not supported"),
    ({"rope_type": "yarn"}, "needs a 'factor'"),
])
def test_unsupported_or_incomplete_scaling_is_refused(rope_scaling: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": rope_scaling})
