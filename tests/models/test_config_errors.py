"""A config the engine cannot serve is a ValueError that names the architecture and what is wrong,
never a KeyError; vLLM's trust_remote_code is accepted and changes nothing."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxengine.arg_utils import add_engine_args, engine_kwargs
from jaxengine.config import EngineConfig
from jaxengine.models.config import ModelConfig

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
GPT2 = dict(architectures=["GPT2LMHeadModel"], vocab_size=50257, n_embd=768, n_layer=12, n_head=12,
            n_positions=1024)  # vLLM's quick-start model's config.json
OPT = dict(architectures=["OPTForCausalLM"], vocab_size=50272, hidden_size=768, ffn_dim=3072,
           num_hidden_layers=12, num_attention_heads=12, word_embed_proj_dim=768, max_position_embeddings=2048,
           do_layer_norm_before=True, activation_function="relu")
PHI3 = dict(architectures=["Phi3ForCausalLM"], vocab_size=1000, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
            original_max_position_embeddings=64)
LONGROPE = dict(type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8)  # head_dim 16: 8 factors


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "NoSuchForCausalLM"])
def test_unsupported_architecture_is_named(arch: str) -> None:
    with pytest.raises(ValueError, match=f"unsupported model architecture '{arch}'; supported: .*LlamaForCausalLM"):
        ModelConfig.from_hf_dict({**LLAMA, "architectures": [arch]})


def test_vllm_quick_start_configs_parse() -> None:
    """gpt2 and facebook/opt-125m, vLLM's quick-start models (their config.json fields)."""
    g = ModelConfig.from_hf_dict(GPT2)
    assert (g.hidden_size, g.num_layers, g.num_heads, g.intermediate_size, g.max_position_embeddings,
            g.tie_word_embeddings, g.hidden_act) == (768, 12, 12, 3072, 1024, True, "gelu_new")
    o = ModelConfig.from_hf_dict(OPT)
    assert (o.hidden_size, o.intermediate_size, o.word_embed_proj_dim, o.do_layer_norm_before,
            o.max_position_embeddings, o.hidden_act) == (768, 3072, 768, True, 2048, "relu")


@pytest.mark.parametrize("cfg, match", [
    ({**GPT2, "add_cross_attention": True}, "GPT2LMHeadModel: add_cross_attention=True"),
    ({**GPT2, "activation_function": "mish"}, "GPT2LMHeadModel: activation 'mish' is not supported"),
    ({**OPT, "enable_bias": False}, "OPTForCausalLM: enable_bias=False is not supported"),
    ({**OPT, "layer_norm_elementwise_affine": False}, "OPTForCausalLM: layer_norm_elementwise_affine=False"),
    ({k: v for k, v in GPT2.items() if k != "n_embd"}, "GPT2LMHeadModel: config.json lacks 'n_embd'"),
    ({k: v for k, v in OPT.items() if k != "ffn_dim"}, "OPTForCausalLM: config.json lacks 'ffn_dim'"),
    # transformers reads a Phi-3 "yarn" as longrope, vLLM as YaRN: refused, as is any other type
    ({**PHI3, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "Phi3ForCausalLM: rope_scaling type 'yarn'"),
    ({**PHI3, "rope_scaling": {"type": "linear", "factor": 2.0}}, "Phi3ForCausalLM: rope_scaling type 'linear'"),
    ({**PHI3, "hidden_act": "gelu_new"}, "Phi3ForCausalLM: hidden_act 'gelu_new' is not supported"),
    ({**PHI3, "rope_scaling": {k: v for k, v in LONGROPE.items() if k != "long_factor"}},
     "Phi3ForCausalLM: rope_scaling of type 'longrope' needs 'long_factor'"),
    ({**PHI3, "rope_scaling": {**LONGROPE, "short_factor": [1.0] * 3}},
     "Phi3ForCausalLM: rope_scaling short_factor has 3 entries; the 16 rotary dimensions need 8"),
    ({**PHI3, "partial_rotary_factor": 0.1}, "Phi3ForCausalLM: partial_rotary_factor=0.1 gives 1 rotary dimensions"),
    ({k: v for k, v in PHI3.items() if k != "hidden_size"}, "Phi3ForCausalLM: config.json lacks 'hidden_size'"),
])
def test_family_specific_refusals_name_the_field(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(cfg)


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
                                   "num_hidden_layers"])
def test_missing_field_is_named_with_the_architecture(field: str) -> None:
    cfg = {k: v for k, v in LLAMA.items() if k != field}
    with pytest.raises(ValueError, match=f"LlamaForCausalLM: config.json lacks '{field}'"):
        ModelConfig.from_hf_dict(cfg)


def test_no_architectures_entry() -> None:
    with pytest.raises(ValueError, match="no 'architectures'"):
        ModelConfig.from_hf_dict({k: v for k, v in LLAMA.items() if k != "architectures"})


def test_an_unsupported_folder_fails_clearly_in_llm(tmp_path) -> None:
    """What a user meets who points LLM at a family this engine does not implement."""
    from jaxengine import LLM

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["DeepseekV3ForCausalLM"]}))
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unsupported model architecture 'DeepseekV3ForCausalLM'"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


def test_trust_remote_code_is_accepted_everywhere() -> None:
    assert EngineConfig(trust_remote_code=True).trust_remote_code
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--trust-remote-code"]))["trust_remote_code"] is True
    assert engine_kwargs(parser.parse_args([]))["trust_remote_code"] is False
