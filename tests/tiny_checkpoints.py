"""Tiny random checkpoints written by transformers' `save_pretrained`, one per model family.

They exercise the real loading path (config.json + safetensors) and serve as the reference
(transformers on PyTorch, CPU, float32).
"""

from __future__ import annotations

import os

import torch
import transformers

VOCAB = 49152  # the SmolLM2 tokenizer's vocabulary, so tiny models can use real text

FAMILIES: dict[str, tuple[type, type, dict]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=24)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    # Qwen2.5's long-context configs: yarn over an original context of 128 positions here.
    "qwen2-yarn": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
    # Learned positions, LayerNorm, biases; the hidden_size-style names map onto GPT-2's n_embd, ...
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, dict(num_key_value_heads=4)),
    "gpt2-tied": (transformers.GPT2Config, transformers.GPT2LMHeadModel, dict(
        num_key_value_heads=4, tie_word_embeddings=True, activation_function="gelu")),
    "opt": (transformers.OPTConfig, transformers.OPTForCausalLM, dict(
        num_key_value_heads=4, ffn_dim=128, tie_word_embeddings=True)),
    # OPT-350m's shape: post-LayerNorm blocks, embeddings narrower than the model (projected in and out)
    "opt-post-ln": (transformers.OPTConfig, transformers.OPTForCausalLM, dict(
        num_key_value_heads=4, ffn_dim=128, tie_word_embeddings=True, do_layer_norm_before=False,
        word_embed_proj_dim=32)),
}


def make_checkpoint(family: str, path: str, *, seed: int = 0, tokenizer=None, num_layers: int = 2,
                    vocab_size: int = VOCAB, **overrides) -> str:
    """Writes a tiny random model of `family` (and the tokenizer, if given) to `path`."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).eval()
    # Larger weights than the default 0.02 init give peaked, informative distributions.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15 if "embed" in name or "lm_head" in name else 0.08)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load_reference(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
