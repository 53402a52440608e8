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
    # Phi-3: fused qkv_proj / gate_up_proj tensors; Phi-3-mini-4k's sliding window, shrunk so prompts pass it.
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(sliding_window=24)),
    # Phi-3.5-mini's longrope over an original context of 64 positions (head_dim 16: 8 factors a list).
    "phi3-longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        original_max_position_embeddings=64, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0], "original_max_position_embeddings": 64})),
    # Phi-4-mini's shape: longrope on the first 3/4 of each head only (6 factors a list), tied embeddings.
    "phi4-mini": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        original_max_position_embeddings=64, partial_rotary_factor=0.75, tie_word_embeddings=True, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0], "original_max_position_embeddings": 64})),
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
    # Gemma 2: a window of 8 (prompts run past it), both soft caps small enough to bite, a score
    # scale other than head_dim's; layer 0 local, layer 1 global.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0, tie_word_embeddings=True)),
    # Gemma 3 text: q/k norms, its own local rope base, linear scaling on the global layers only.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_theta=10000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=True)),
    # Mixture of experts: 4 experts, top-2, every layer sparse (Mixtral's router: softmax of the top-k logits).
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=96)),
    # Qwen3-MoE: q/k norm, layer 0 dense (mlp_only_layers), top-2 of 4 not renormalised (Mixtral
    # covers renormalised weights; tests/models/test_moe.py the rules and decoder_sparse_step).
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[0],
        norm_topk_prob=False)),
}
# Families whose norm weights are random too (Gemma's zero-initialised (1 + weight) norms would
# otherwise leave the weight untested).
RANDOM_NORMS = {"gemma2", "gemma3"}


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
            elif family in RANDOM_NORMS and name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load_reference(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
