"""A steady decode step's forward and sampler as one program (model_runner.FUSED_DECODE_SAMPLE)
gives the tokens, logprobs and texts of the two-program step, compiles its programs at start-up,
and leaves every other kind of step on the two-program path."""

from __future__ import annotations

import pytest

from jaxengine import LLM, SamplingParams
from jaxengine import model_runner
from tests.engine.test_engine import ENGINE_KW, PROMPTS
from jaxengine.compile_monitor import compile_count

WORKLOAD = [
    (PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    (PROMPTS[:4], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3, logprobs=2)),
    (PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0.7, seed=5, repetition_penalty=1.3)),  # processors
    (PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=1)),
]


def _run(path: str, cache: str, fused: bool, monkeypatch) -> tuple[list, LLM, int]:
    monkeypatch.setattr(model_runner, "FUSED_DECODE_SAMPLE", fused)
    llm = LLM(path, compilation_cache_dir=cache, **ENGINE_KW)
    runner = llm.llm_engine.runner
    calls = []
    real = runner._decode_sample_fns.copy()
    for key, fn in real.items():  # count the fused program's launches
        runner._decode_sample_fns[key] = (lambda f, k: lambda *a: calls.append(k) or f(*a))(fn, key)
    before = compile_count()
    outs = [[(c.token_ids, c.text, [sorted(d) for d in (c.logprobs or [])]) for o in llm.generate(p, sp, use_tqdm=False)
             for c in o.outputs] for p, sp in WORKLOAD]
    assert compile_count() == before  # every program was compiled at start-up
    return outs, llm, len(calls)


def test_fused_decode_step_equals_two_programs(tiny_model_factory, xla_cache_dir, monkeypatch):
    path = tiny_model_factory("llama")
    want, _, none = _run(path, xla_cache_dir, False, monkeypatch)
    got, llm, fused_calls = _run(path, xla_cache_dir, True, monkeypatch)
    assert none == 0 and fused_calls > 0
    runner = llm.llm_engine.runner
    assert sorted(runner._decode_sample_fns) == [(t, tr) for t in runner.decode_buckets() for tr in (False, True)]
    assert got == want


@pytest.mark.parametrize("max_num_seqs,want", [(8, [8]), (16, [8, 16]), (20, [8, 16, 32])])
def test_decode_buckets_cover_every_row_count(max_num_seqs, want, monkeypatch):
    class Runner:
        token_buckets = [8, 16, 32, 64]
        config = type("C", (), {"max_num_seqs": max_num_seqs})()

    assert model_runner.ModelRunner.decode_buckets(Runner()) == want
