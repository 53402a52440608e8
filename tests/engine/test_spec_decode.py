"""Speculative decoding with the n-gram proposer: exactly greedy's tokens, the target's
distribution when sampling, acceptance counted, and the scheduler's bookkeeping of drafts."""

from __future__ import annotations

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.config import EngineConfig
from jaxengine.request import Request
from jaxengine.scheduler import Scheduler, SchedulerConfig
from jaxengine.spec_decode import SpeculativeConfig, ngram_propose

ENGINE_KW = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=128, block_size=16)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3",
    "Hello, my name is",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
]


def _chi2_sf(x: float, df: int) -> float:
    """The chi-square survival function by the Wilson-Hilferty approximation (no scipy needed)."""
    import math

    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


# -- host parts ------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    assert ngram_propose([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 4) == [4, 5, 1]
    assert ngram_propose([7, 1, 2, 9, 1, 2, 8, 1, 2], 2, 1, 3) == [8, 1]  # the most recent match
    assert ngram_propose([1, 2, 3, 4], 3, 1, 4) == []
    assert ngram_propose([5, 6, 5, 6, 5], 2, 1, 3) == [6, 5]
    assert ngram_propose([4, 4, 4], 5, 1, 2) == [4]  # only what follows exists
    assert ngram_propose([9, 1, 2, 3, 1, 2], 3, 3, 3) == []  # below prompt_lookup_min


def test_speculative_config_is_validated_by_key():
    c = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}').speculative_config
    assert c == SpeculativeConfig(num_speculative_tokens=4)
    draft = EngineConfig(speculative_config={"model": "/some/draft", "num_speculative_tokens": 4}).speculative_config
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/some/draft", 4)
    for bad, what in (({"num_speculative_tokens": 0}, "num_speculative_tokens"), ({"bogus": 1}, "bogus"),
                      ({"method": "draft_model"}, "needs \"model\""), ({"method": "eagle3"}, "eagle3"),
                      ({"method": "ngram", "model": "/some/draft"}, "does not go with"),
                      ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"), ("{", "JSON")):
        with pytest.raises(ValueError, match=what):
            EngineConfig(speculative_config=bad)


def test_the_command_line_flag_takes_json():
    from jaxengine.arg_utils import engine_kwargs, normalize_flags
    from jaxengine.cli import build_parser

    args = build_parser().parse_args(normalize_flags(["generate", "hi", "--speculative_config",
                                                      '{"method": "ngram", "num_speculative_tokens": 5}']))
    config = EngineConfig(**engine_kwargs(args))
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=5)


def _scheduler(block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=32,
                                     block_size=block_size))


def test_scheduler_gives_drafts_slots_and_counts_only_verified_tokens():
    s = _scheduler()
    req = Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=20, temperature=0))
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, [10])  # the prompt's step samples token 10
    s.set_drafts(req, [11, 12, 13])
    out = s.schedule()
    [row] = out.seqs
    assert (row.start, row.num_new_tokens, row.token_ids, row.num_drafts) == (7, 4, [10, 11, 12, 13], 3)
    assert len(row.block_ids) * 4 >= 11  # slots for every draft
    s.advance(out)
    assert req.num_computed_tokens == 8  # drafts are not computed until verified
    s.resolve(out, [[11, 12, 99]])  # two drafts accepted, then the target's own token
    assert req.output_token_ids == [10, 11, 12, 99] and req.num_computed_tokens == 10
    # blocks are hashed over verified tokens only: the first two full blocks (8 tokens)
    assert len(req.block_hashes) == 2
    out = s.schedule()
    assert out.seqs[0].token_ids == [99] and out.seqs[0].num_drafts == 0


def test_a_stop_inside_the_accepted_tokens_drops_the_rest():
    s = _scheduler()
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[12]))
    s.add_request(req)
    s.update_from_output(s.schedule(), [10])
    s.set_drafts(req, [11, 12, 13])
    out = s.schedule()
    s.advance(out)
    tokens = [11, 12, 13, 14]
    finished = s.resolve(out, [tokens])
    assert finished == [req] and req.output_token_ids == [10, 11, 12] and tokens == [11, 12]
    assert req.stop_reason == 12


def test_drafts_are_cut_to_max_tokens():
    s = _scheduler()
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    s.add_request(req)
    s.update_from_output(s.schedule(), [10])
    s.set_drafts(req, [11, 12, 13])
    [row] = s.schedule().seqs
    assert row.num_drafts == 1  # 1 output so far + 1 draft + the target's token = max_tokens


# -- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llms(tiny_model_factory, xla_cache_dir):
    path = tiny_model_factory("llama")
    plain = LLM(path, compilation_cache_dir=xla_cache_dir, **ENGINE_KW)
    spec = LLM(path, compilation_cache_dir=xla_cache_dir, speculative_config=NGRAM, **ENGINE_KW)
    return plain, spec


def test_greedy_with_ngram_speculation_equals_greedy_without(llms):
    plain, spec = llms
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    for batch in ([p] for p in PROMPTS):  # batch 1
        assert [o.outputs[0].token_ids for o in spec.generate(batch, params)] == [want[PROMPTS.index(batch[0])]]
    got = spec.generate(PROMPTS, params)  # mixed batch: rows with and without drafts
    assert [o.outputs[0].token_ids for o in got] == want
    stats = spec.llm_engine.core.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    m = got[0].metrics
    assert m.spec_num_draft_tokens > 0 and 0.0 <= m.spec_acceptance_rate <= 1.0
    assert m.spec_mean_accepted_length >= 1.0


def test_speculation_with_chunked_prefill_logprobs_and_stops(llms):
    plain, spec = llms
    long_prompt = " ".join(["alpha beta gamma delta"] * 20)  # more tokens than one step's budget
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    a, b = plain.generate([long_prompt], params)[0].outputs[0], spec.generate([long_prompt], params)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for la, lb in zip(a.logprobs, b.logprobs):
        assert set(la) == set(lb)
        for t in la:
            assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4) and la[t].rank == lb[t].rank
    text = plain.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        stopped = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
        assert (spec.generate([PROMPTS[1]], stopped)[0].outputs[0].text
                == plain.generate([PROMPTS[1]], stopped)[0].outputs[0].text)


def test_speculation_under_preemption_gives_the_same_tokens(tiny_model_factory, xla_cache_dir, llms):
    plain, _ = llms
    path = tiny_model_factory("llama")
    tight = LLM(path, compilation_cache_dir=xla_cache_dir, speculative_config=NGRAM,
                **{**ENGINE_KW, "num_kv_blocks": 17})
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS * 2
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert got == want


def test_sampling_with_speculation_has_the_targets_distribution(llms):
    """Many seeded samples of the 2nd and 3rd output tokens, with and without speculation, on a
    prompt that makes the n-gram proposer draft: the two histograms agree (chi-square)."""
    plain, spec = llms
    prompt = PROMPTS[1]
    n = 8
    counts = {}
    for name, llm in (("plain", plain), ("spec", spec)):
        c: dict[tuple[int, int], int] = {}
        for r in range(30):
            outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, top_k=4, seed=1000 * r + i, max_tokens=3,
                                                             ignore_eos=True) for i in range(n)], use_tqdm=False)
            for o in outs:
                for pos in (1, 2):
                    key = (pos, o.outputs[0].token_ids[pos])
                    c[key] = c.get(key, 0) + 1
        counts[name] = c
    assert spec.llm_engine.core.spec_stats.num_drafts > 0
    keys = sorted(set(counts["plain"]) | set(counts["spec"]))
    a = np.array([counts["plain"].get(k, 0) for k in keys], float)
    b = np.array([counts["spec"].get(k, 0) for k in keys], float)
    keep = (a + b) >= 10  # pool rare cells
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    nz = (a + b) > 0
    a, b = a[nz], b[nz]
    expected_a = (a + b) * a.sum() / (a.sum() + b.sum())
    expected_b = (a + b) * b.sum() / (a.sum() + b.sum())
    chi2 = (((a - expected_a) ** 2) / expected_a + ((b - expected_b) ** 2) / expected_b).sum()
    assert _chi2_sf(chi2, len(a) - 1) > 1e-3, (chi2, len(a))


def test_acceptance_is_high_on_a_prompt_that_repeats_itself(xla_cache_dir):
    from tests.engine.test_structured_outputs import ENGINE_KW as SMOLLM2_KW

    # the structured-output tests' SmolLM2 settings: only the verify programs are new to the cache
    llm = LLM(compilation_cache_dir=xla_cache_dir, speculative_config=NGRAM, **SMOLLM2_KW)
    prompt = "Repeat the list exactly.\nred, green, blue, yellow, red, green, blue, yellow, red, green, blue, yellow,"
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    stats = llm.llm_engine.core.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate > 0.5, (stats, out.outputs[0].text)
    assert out.metrics.spec_mean_accepted_length > 2.0


def test_spec_decode_counters_in_metrics(llms):
    import httpx

    from jaxengine.async_engine import AsyncEngine
    from jaxengine.server.api_server import build_app
    from tests.server.conftest import LiveServer

    _, spec = llms
    app = build_app(AsyncEngine(spec.llm_engine), served_model_names=["tiny"], metrics_vllm_names=True)
    with LiveServer(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 16,
                                                            "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        srv.app.state.engine.call_threadsafe(lambda e: None, timeout=10)
        text = httpx.get(srv.url + "/metrics").text
    st = spec.llm_engine.core.spec_stats
    for name, value in (("spec_decode_num_drafts_total", st.num_drafts),
                        ("spec_decode_num_draft_tokens_total", st.num_draft_tokens),
                        ("spec_decode_num_accepted_tokens_total", st.num_accepted_tokens)):
        for prefix in ("jaxengine:", "vllm:"):
            assert f'{prefix}{name}{{model_name="tiny"}} {float(value)}' in text, (prefix, name)
    assert st.num_draft_tokens > 0
    assert 'jaxengine:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text


def test_dry_rounds_back_off(llms, monkeypatch):
    """When nothing is ever drafted, proposal rounds (each a synchronous step) thin out: after
    dry rounds the engine skips 1, 3, 7, then 8 steps, and its tokens are unchanged."""
    import jaxengine.engine_core as engine_core

    plain, spec = llms
    rounds = []
    monkeypatch.setattr(engine_core, "ngram_propose", lambda tokens, *a: rounds.append(len(tokens)) or [])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got = spec.generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    assert got == plain.generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    outputs_at = [n - len(spec.get_tokenizer().encode(PROMPTS[2])) for n in rounds]
    gaps = [b - a for a, b in zip(outputs_at, outputs_at[1:])]
    assert gaps[:4] == [2, 4, 8, 9] and set(gaps[4:]) <= {9}, gaps
