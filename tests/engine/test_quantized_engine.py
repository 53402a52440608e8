"""The engine with quantized weights: `LLM(quantization=...)` and `--quantization`, a GPTQ
checkpoint generating the same greedy tokens as its dequantized float twin, fp8 at load time with
an fp8 KV cache running end to end, and unsupported methods refused at configuration time."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from safetensors.numpy import load_file

from jaxengine import LLM, SamplingParams
from jaxengine.arg_utils import add_engine_args, engine_kwargs
from jaxengine.config import EngineConfig
from jaxengine.xla_options import program_options
from tests.models.test_quantization import _make
from tests.tiny_checkpoints import make_checkpoint

_ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, warmup=False,
               dtype="float32", skip_tokenizer_init=True)
_PROMPTS = [[5, 17, 300, 42, 9, 77], [100, 200, 300]]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("qengine")), vocab_size=512, num_layers=1)


def test_gptq_engine_matches_dequantized(tiny, xla_cache_dir, tmp_path):
    qpath, refpath = _make("gptq", (tiny, load_file(f"{tiny}/model.safetensors")), tmp_path)
    llm = LLM(qpath, quantization="gptq_marlin", compilation_cache_dir=xla_cache_dir, **_ENGINE)
    assert program_options(llm.llm_engine.runner.state, 512) == {}  # weight-only: XLA's defaults
    quantized = _greedy(llm)
    assert quantized == _greedy(LLM(refpath, compilation_cache_dir=xla_cache_dir, **_ENGINE))


def test_gguf_kept_quantized_engine_matches_dequantized(tmp_path, xla_cache_dir):
    """A GGUF file mixing Q4_K, Q6_K, Q4_1, Q8_0 and Q4_0 linears (q/k/v and gate/up in different
    forms: separate projections) generates, with quantization="gguf", the greedy tokens of the
    same file loaded dequantized."""
    from tests.models.test_gguf_blocks import _write

    path = tmp_path / "mixed.gguf"
    _write(path, {"blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K", "blk.0.attn_v": "Q6_K", "blk.0.attn_output": "Q4_K",
                  "blk.0.ffn_gate": "Q4_1", "blk.0.ffn_up": "Q8_0", "blk.0.ffn_down": "Q4_0"})
    engine = dict(_ENGINE, compilation_cache_dir=xla_cache_dir)
    llm = LLM(str(path), quantization="gguf", **engine)
    assert not llm.llm_engine.model_config.fused_projections
    prompts = [{"prompt_token_ids": [5, 17, 30, 42, 9]}, {"prompt_token_ids": [10, 20, 30]}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kept = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    ref = LLM(str(path), **engine)
    assert kept == [list(o.outputs[0].token_ids) for o in ref.generate(prompts, params, use_tqdm=False)]


def test_fp8_weights_and_fp8_kv_cache_generate(tiny, xla_cache_dir):
    llm = LLM(tiny, quantization="fp8", kv_cache_dtype="fp8",
              compilation_cache_dir=xla_cache_dir, **_ENGINE)
    assert all(len(t) == 8 for t in _greedy(llm))
    k_cache = llm.llm_engine.runner.kv_caches[0][0]
    assert k_cache.dtype == jnp.float8_e4m3fn
    # fp8 weights send every dot above the decode rows to cuBLASLt on GPU (no Triton GEMM
    # autotuning of large buckets); the decode rows' converts fuse into Triton GEMMs
    assert program_options(llm.llm_engine.runner.state, 32) == {"xla_gpu_enable_triton_gemm": False}
    assert program_options(llm.llm_engine.runner.state, 16) == {}


def test_quantization_flag_and_refusals():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--quantization", "fp8"]))["quantization"] == "fp8"
    assert engine_kwargs(parser.parse_args([]))["quantization"] is None
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported; supported: fp8, compressed-tensors"):
        EngineConfig(quantization="bitsandbytes")
