"""Speculative decoding with a draft model: exactly greedy's tokens whatever the draft proposes,
the target's distribution when sampling, full acceptance when the draft is the target itself,
the draft's KV caught up after preemption, and clear errors for what is not served."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.config import EngineConfig
from jaxengine.models.config import ModelConfig
from jaxengine.models.presets import PRESETS
from tests.engine.test_spec_decode import ENGINE_KW, PROMPTS, _chi2_sf

K = 3


@pytest.fixture(scope="module")
def engines(tiny_model_factory, xla_cache_dir):
    """The tiny llama without speculation, and with itself as its draft model in a KV cache so
    small that a batch of the test prompts is preempted (every test below also runs the draft's
    catch-up after preemption)."""
    target = tiny_model_factory("llama")
    plain = LLM(target, compilation_cache_dir=xla_cache_dir, **ENGINE_KW)
    spec = LLM(target, compilation_cache_dir=xla_cache_dir, **{**ENGINE_KW, "num_kv_blocks": 17},
               speculative_config={"model": target, "num_speculative_tokens": K})
    return plain, spec


def test_greedy_with_a_draft_model_equals_greedy_without(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS * 2
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts[:1], params)] == want[:1]  # batch 1
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want  # mixed batch, preempted
    assert spec.llm_engine.scheduler.num_preemptions > 0
    # chunked prefill: a prompt longer than a step's token budget, caught up by the draft in chunks
    long_prompt = " ".join(["alpha beta gamma delta"] * 20)
    assert (spec.generate([long_prompt], params)[0].outputs[0].token_ids
            == plain.generate([long_prompt], params)[0].outputs[0].token_ids)
    # the draft's KV is right, preempted requests' included: the target as its own draft is
    # (up to float rounding on near-ties) always accepted
    stats = spec.llm_engine.core.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.95, stats


def test_the_target_as_its_own_draft_is_always_accepted(engines):
    _, spec = engines
    stats = spec.llm_engine.core.spec_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    [out] = spec.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
    assert out.metrics.spec_acceptance_rate == 1.0 and out.metrics.spec_mean_accepted_length > K


def test_sampling_with_a_draft_model_has_the_targets_distribution(engines):
    """Seeded samples of output tokens 1 and 2, with and without the draft (the target itself:
    its greedy drafts are accepted with the target's probability of them, so sometimes not):
    the histograms agree (chi-square)."""
    plain, spec = engines
    st = spec.llm_engine.core.spec_stats
    before = (st.num_draft_tokens, st.num_accepted_tokens)
    n, counts = 8, {}
    for name, llm in (("plain", plain), ("spec", spec)):
        c: dict[tuple[int, int], int] = {}
        for r in range(24):
            outs = llm.generate([PROMPTS[2]] * n, [SamplingParams(temperature=1.0, top_k=4, seed=1000 * r + i,
                                                                  max_tokens=3, ignore_eos=True) for i in range(n)],
                                use_tqdm=False)
            for o in outs:
                for pos in (1, 2):
                    key = (pos, o.outputs[0].token_ids[pos])
                    c[key] = c.get(key, 0) + 1
        counts[name] = c
    assert 0 < st.num_accepted_tokens - before[1] < st.num_draft_tokens - before[0]
    keys = sorted(set(counts["plain"]) | set(counts["spec"]))
    a = np.array([counts["plain"].get(k, 0) for k in keys], float)
    b = np.array([counts["spec"].get(k, 0) for k in keys], float)
    keep = (a + b) >= 10
    a, b = np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())
    nz = (a + b) > 0
    a, b = a[nz], b[nz]
    ea, eb = (a + b) * a.sum() / (a.sum() + b.sum()), (a + b) * b.sum() / (a.sum() + b.sum())
    chi2 = (((a - ea) ** 2) / ea + ((b - eb) ** 2) / eb).sum()
    assert _chi2_sf(chi2, len(a) - 1) > 1e-3, (chi2, len(a))


def test_draft_models_that_cannot_serve_are_refused():
    from jaxengine.loading import load_draft

    target = ModelConfig.from_hf_dict(PRESETS["smollm2-135m"])
    spec = {"model": "llama-3.2-1b", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary"):  # Llama 3's 128256 tokens for SmolLM2's 49152
        load_draft(EngineConfig(load_format="dummy", max_model_len=256, speculative_config=spec), target, jnp.float32)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        load_draft(EngineConfig(load_format="dummy", max_model_len=256, tensor_parallel_size=2,
                                speculative_config=spec), target, jnp.float32)
    windowed = ModelConfig.from_hf_dict({**PRESETS["smollm2-135m"], "architectures": ["MistralForCausalLM"],
                                         "sliding_window": 64})
    with pytest.raises(ValueError, match="sliding window"):
        load_draft(EngineConfig(load_format="dummy", max_model_len=256, speculative_config=spec), windowed, jnp.float32)
