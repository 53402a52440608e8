"""Phi-3 beyond the per-family tests of test_model.py: the fused checkpoint tensors, longrope's
context-dependent factor list (as vLLM chooses it, against transformers where they agree), and
the `phi-3-mini` preset through the engine."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxengine.config import EngineConfig
from jaxengine.loading import derive_config
from jaxengine.models.checkpoint import open_checkpoint
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import abstract_model, load_params
from jaxengine.models.presets import PRESETS
from jaxengine.sharding import LOGICAL_AXES
from tests.model_harness import PagedRunner
from tests.models.test_model import ATOL, _reference_logits, _rewrite_tensors
from tests.tiny_checkpoints import load_reference, make_checkpoint

ORIGINAL = 64  # the tiny longrope checkpoint's original context (max_position_embeddings 512)


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    path = make_checkpoint("phi3-longrope", str(tmp_path_factory.mktemp("phi3_longrope")))
    ckpt = open_checkpoint(path)
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config)
    return path, ckpt, cfg, load_reference(path)


def _runner(ckpt, cfg: ModelConfig) -> PagedRunner:
    graphdef, state = load_params(ckpt, cfg, jnp.float32)
    return PagedRunner(graphdef, state, cfg, num_blocks=32, max_len=256)


def test_split_projections_load_from_the_fused_tensors(longrope):
    """qkv_proj and gate_up_proj split into the parts the rules table shards (tensor parallelism),
    also with each KV head repeated (more devices than KV heads), with the fused model's logits."""
    _, ckpt, cfg, _ = longrope
    toks = list(range(3, 40))
    fused = _runner(ckpt, cfg).step([(0, toks, 0)])[0]
    for split_cfg in (cfg.with_split_projections(), cfg.with_kv_head_replicas(2).with_split_projections()):
        graphdef, state = load_params(ckpt, split_cfg, jnp.float32)
        names = {str(k[-1]) for k, _ in nnx.to_flat_state(state)}
        assert {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} <= names <= set(LOGICAL_AXES)
        split = PagedRunner(graphdef, state, split_cfg).step([(0, toks, 0)])[0]
        np.testing.assert_allclose(split, fused, atol=ATOL, rtol=0)


def test_a_fused_tensor_of_the_wrong_shape_is_named(longrope, tmp_path):
    import shutil
    path = str(tmp_path / "m")
    shutil.copytree(longrope[0], path)
    _rewrite_tensors(path, lambda t: t.__setitem__("model.layers.1.self_attn.qkv_proj.weight",
                                                  np.zeros((100, 64), np.float32)))
    ckpt = open_checkpoint(path)
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj.weight: checkpoint shape \(100, 64\)"):
        load_params(ckpt, ModelConfig.from_hf_dict(ckpt.hf_config), jnp.float32)


def test_default_context_is_the_original_one(longrope):
    """As in vLLM: a longrope model serves its original context unless asked for more (up to
    max_position_embeddings), and the engine's context picks the factor list."""
    *_, cfg, _ = longrope
    assert derive_config(EngineConfig(), cfg).max_model_len == ORIGINAL
    assert derive_config(EngineConfig(max_model_len=512), cfg).max_model_len == 512
    with pytest.raises(ValueError, match="max_model_len=513 exceeds the model's max_position_embeddings=512"):
        derive_config(EngineConfig(max_model_len=513), cfg)
    assert not cfg.rope_scaling.long_context
    assert not cfg.with_max_model_len(ORIGINAL).rope_scaling.long_context
    assert cfg.with_max_model_len(ORIGINAL + 1).rope_scaling.long_context


def test_long_context_engine_matches_transformers_past_the_original_context(longrope):
    """An engine whose context exceeds the original one uses the long factors at every position:
    a 100-token sequence, prefilled in chunks and decoded across position 64, gives transformers'
    logits for it (transformers also takes the long factors for a sequence longer than 64)."""
    _, ckpt, cfg, ref = longrope
    long_cfg = cfg.with_max_model_len(512)
    toks = [int(t) for t in np.random.default_rng(3).integers(0, cfg.vocab_size, size=100)]
    want = _reference_logits(ref, toks)
    runner = _runner(ckpt, long_cfg)
    rows = [runner.step([(0, toks[:40], 0)])[0], runner.step([(0, toks[:80], 40)])[0]]
    rows += [runner.step([(0, toks[:n], n - 1)])[0] for n in range(81, 101)]
    np.testing.assert_allclose(np.concatenate(rows), want, atol=ATOL, rtol=0)
    # the same sequence in an engine of the original context would have used the short factors
    assert np.abs(_runner(ckpt, cfg).step([(0, toks[:ORIGINAL], 0)])[0] - want[:ORIGINAL]).max() > 1e-2


def test_long_context_engine_uses_long_factors_for_short_prompts_too(longrope):
    """Where vLLM and transformers part: a 30-token prompt in a long-context engine is rotated with
    the long factors (so its keys need no re-rotation as it grows), while transformers, which
    re-computes the cache when a sequence first passes the original context, uses the short ones.
    With its short-factor frequencies replaced by the long ones, transformers gives our logits."""
    path, ckpt, cfg, _ = longrope
    toks = list(range(5, 35))
    ours_long = _runner(ckpt, cfg.with_max_model_len(512)).step([(0, toks, 0)])[0]
    ours_short = _runner(ckpt, cfg).step([(0, toks, 0)])[0]
    ref = load_reference(path)
    np.testing.assert_allclose(ours_short, _reference_logits(ref, toks), atol=ATOL, rtol=0)
    long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](ref.config, "cpu", seq_len=ORIGINAL + 1)
    with torch.no_grad():
        ref.model.rotary_emb.original_inv_freq.copy_(long_inv)  # what transformers uses up to the original context
    np.testing.assert_allclose(ours_long, _reference_logits(ref, toks), atol=ATOL, rtol=0)
    assert np.abs(ours_long - ours_short).max() > 1e-2


def test_engine_greedy_past_the_original_context_matches_transformers(longrope):
    """LLM with max_model_len 512 builds the long-factor model and generates transformers' greedy
    tokens for a 70-token prompt (long factors throughout on both sides)."""
    from jaxengine import LLM, SamplingParams
    from tests.engine.test_engine import assert_close_greedy

    path, _, _, ref = longrope
    llm = LLM(path, max_model_len=512, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=40,
              dtype="float32", skip_tokenizer_init=True, compilation_cache_dir=None)
    assert llm.llm_engine.model_config.rope_scaling.long_context
    ids = [int(t) for t in np.random.default_rng(4).integers(3, 1000, size=70)]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                                  logprobs=5), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        gen = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    ref_lp = torch.log_softmax(torch.stack(gen.logits)[:, 0].float(), -1).numpy()
    assert_close_greedy(out, gen.sequences[0, len(ids):].tolist(), ref_lp)


def test_phi3_mini_preset(monkeypatch):
    """The `phi-3-mini` dummy preset (Phi-3-mini-4k-instruct's config.json): its shape and
    parameter count, and a shrunken copy of it (2 layers, narrower) generating through LLM on CPU."""
    from jaxengine import LLM, SamplingParams

    cfg = ModelConfig.from_hf_dict(PRESETS["phi-3-mini"])
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window,
            cfg.rope_scaling, cfg.max_position_embeddings, cfg.eos_token_id, cfg.torch_dtype) == (
        "Phi3ForCausalLM", 32, 32, 32, 96, 2047, None, 4096, (32000,), "bfloat16")
    assert round(cfg.num_params() / 1e9, 2) == 3.82  # Phi-3-mini: 3.8B
    layer = abstract_model(cfg, jnp.bfloat16)[1]["model"]["layers"][31]
    assert layer["self_attn"]["qkv_proj"].shape == (3072, 96, 96)
    assert layer["mlp"]["gate_up_proj"].shape == (3072, 16384)
    # the whole preset runs in float32 on a GPU (`jaxengine bench --model phi-3-mini --load-format dummy`);
    # 15 GB of weights and 7.6 GFLOP a token are too much for a CPU test
    monkeypatch.setitem(PRESETS, "phi-3-mini-small", dict(
        PRESETS["phi-3-mini"], hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, sliding_window=48))
    llm = LLM("phi-3-mini-small", load_format="dummy", max_model_len=256, max_num_seqs=4, num_kv_blocks=64,
              dtype="float32", skip_tokenizer_init=True, compilation_cache_dir=None)
    out = llm.generate([{"prompt_token_ids": list(range(1, 80))}],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert llm.llm_engine.model_config.sliding_window == 48
