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
           num_hidden_layers=12, num_attention_heads=12, word_embed_proj_dim=768)


@pytest.mark.parametrize("cfg, arch", [(GPT2, "GPT2LMHeadModel"), (OPT, "OPTForCausalLM"),
                                       ({**LLAMA, "architectures": ["NoSuchForCausalLM"]}, "NoSuchForCausalLM")])
def test_unsupported_architecture_is_named(cfg: dict, arch: str) -> None:
    with pytest.raises(ValueError, match=f"unsupported model architecture '{arch}'; supported: .*LlamaForCausalLM"):
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


def test_a_gpt2_folder_fails_clearly_in_llm(tmp_path) -> None:
    """What a vLLM user meets who tries its quick-start model `gpt2` here."""
    from jaxengine import LLM

    (tmp_path / "config.json").write_text(json.dumps(GPT2))
    save_file({"wte.weight": np.zeros((4, 4), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


def test_trust_remote_code_is_accepted_everywhere() -> None:
    assert EngineConfig(trust_remote_code=True).trust_remote_code
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--trust-remote-code"]))["trust_remote_code"] is True
    assert engine_kwargs(parser.parse_args([]))["trust_remote_code"] is False
