"""With model_runner.DECODE_ONLY_PROGRAMS on (off by default: it lengthens the cold start), decode-only
steps run programs of their own where the attention kernel has a decode-only path (the Pallas GPU
kernels: no prefill kernel launched for a step whose every row is one token); elsewhere, and by
default, one program per token bucket serves every step."""

from __future__ import annotations

import functools

import numpy as np

from jaxengine import LLM, SamplingParams
from jaxengine.attention_backend import AttentionBackend
from jaxengine.compile_monitor import compile_count
from jaxengine.config import pick_bucket
from jaxengine.pallas_kernels import ragged_paged_attention_gpu as rpa_gpu
from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.engine.test_attention_backend import _step

PROMPTS = ["Hello, my name is", "a", "The quick brown fox jumps over the lazy dog. The quick brown fox", "1 2 3"]


def _recording_reference(seen: list, q, *args, decode_only: bool = False, **kwargs):
    """The jnp reference, recording (at trace time) which kind of step each program was traced for."""
    seen.append(decode_only)
    return ragged_paged_attention_reference(q, *args, **kwargs)


def _engine(path: str, monkeypatch, decode_only_path: bool, seen: list, warmup: bool = True) -> LLM:
    from jaxengine import loading

    def select(*args, **kwargs) -> AttentionBackend:
        return AttentionBackend("reference", "recording reference", functools.partial(_recording_reference, seen),
                                decode_only_path=decode_only_path)

    monkeypatch.setattr(loading, "select_attention_backend", select)
    return LLM(path, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64,
               block_size=16, warmup=warmup, compilation_cache_dir=None)


def test_decode_steps_take_the_decode_only_programs(tiny_model_factory, monkeypatch):
    """With model_runner.DECODE_ONLY_PROGRAMS on and a kernel that has the path: warm-up compiles a decode-only forward for each token
    bucket a decode-only step can take (up to the one max_num_seqs rows need), traced with
    `decode_only=True`; steps of one token a row run it, prompt chunks run the mixed program, no
    program compiles after warm-up, and the greedy tokens are those of an engine without it."""
    from jaxengine import model_runner

    path = tiny_model_factory("llama")
    monkeypatch.setattr(model_runner, "DECODE_ONLY_PROGRAMS", True)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seen_plain: list = []
    plain = _engine(path, monkeypatch, False, seen_plain, warmup=False)  # compiles what it runs
    assert plain.llm_engine.runner.attention_decode is None and plain.llm_engine.runner.decode_buckets == ()
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy, use_tqdm=False)]
    assert set(seen_plain) == {False}
    del plain

    seen: list = []
    llm = _engine(path, monkeypatch, True, seen)
    runner = llm.llm_engine.runner
    buckets = runner.token_buckets
    assert runner.decode_buckets == tuple(t for t in buckets if t <= pick_bucket(buckets, 4))
    assert set(runner._forward_decode_fns) == set(runner.decode_buckets)
    assert True in seen and False in seen  # both kinds traced at warm-up
    calls = {"mixed": 0, "decode": 0}
    for kind, getter in (("mixed", "_get_forward"), ("decode", "_get_forward_decode")):
        orig = getattr(runner, getter)

        def counted(t, orig=orig, kind=kind):
            calls[kind] += 1
            return orig(t)
        monkeypatch.setattr(runner, getter, counted)
    before = compile_count()
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert compile_count() == before
    assert got == want
    assert calls["mixed"] >= 1 and calls["decode"] >= 10  # the prompts' chunks, then 11 decode steps or more


def test_cpu_and_reference_backends_have_no_decode_only_programs():
    """The CPU path and the jnp reference attend in one function: no second program; and the
    engine's default builds none anywhere (DECODE_ONLY_PROGRAMS off)."""
    from jaxengine import model_runner

    assert model_runner.DECODE_ONLY_PROGRAMS is False
    from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_cpu

    for fn in (ragged_paged_attention_cpu, ragged_paged_attention_reference):
        assert AttentionBackend("auto", "x", fn).for_decode_only_steps() is None


def test_decode_only_backend_equals_the_mixed_one_on_a_decode_step():
    """The Triton kernels (interpreted): on a step whose every live row is one token, the
    decode-only backend's attend (decode kernel alone) gives the mixed backend's output and cache."""
    b, k, v, md = _step(np.random.default_rng(7), q_lens=(1, 1, 1), ctx_lens=(20, 3, 40))
    fn = functools.partial(rpa_gpu.ragged_paged_attention_gpu, interpret=True)
    mixed = AttentionBackend("pallas", "ragged_paged_attention_gpu", fn, decode_only_path=True)
    decode = mixed.for_decode_only_steps()
    assert decode.decode_only and decode.description.endswith("decode-only steps")
    outs = [be.attend(b.q, k, v, (b.k_cache, b.v_cache), md, sm_scale=0.25) for be in (mixed, decode)]
    np.testing.assert_allclose(np.asarray(outs[1][0]), np.asarray(outs[0][0]), rtol=1e-5, atol=1e-5)
    for a, c in zip(outs[0][1], outs[1][1]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
