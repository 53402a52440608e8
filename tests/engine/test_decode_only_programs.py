"""With model_runner.DECODE_ONLY_PROGRAMS on (off by default: it lengthens the cold start), decode-only
steps run programs of their own where the attention kernel has a decode-only path (the Pallas GPU
kernels: no prefill kernel launched for a step whose every row is one token); elsewhere, and by
default, one program per token bucket serves every step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
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


def _engine(path: str, monkeypatch, decode_only_path: bool, seen: list, warmup: bool = True,
            rope_write_fn=None) -> LLM:
    from jaxengine import loading

    def select(*args, **kwargs) -> AttentionBackend:
        return AttentionBackend("reference", "recording reference", functools.partial(_recording_reference, seen),
                                decode_only_path=decode_only_path, rope_write_fn=rope_write_fn)

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


def _recording_rope_write(seen: list, *args, **kwargs):
    """The one-launch decode kernel (interpreted), recording its traces."""
    seen.append("rope_write")
    return rpa_gpu.decode_attention_rope_write(*args, **kwargs, interpret=True)


def test_decode_only_programs_rotate_write_and_attend_in_one_kernel(tiny_model_factory, monkeypatch):
    """With a backend that has the one-launch decode kernel (rope_write_fn: rotary embedding, cache
    write and attention), the decode-only programs run it in every layer and the mixed programs
    do not; the greedy tokens are those of an engine that rotates and writes in XLA."""
    from jaxengine import model_runner

    path = tiny_model_factory("llama")
    monkeypatch.setattr(model_runner, "DECODE_ONLY_PROGRAMS", True)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = _engine(path, monkeypatch, False, [], warmup=False)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy, use_tqdm=False)]
    del plain

    seen: list = []
    llm = _engine(path, monkeypatch, True, seen, warmup=False,
                  rope_write_fn=functools.partial(_recording_rope_write, seen))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == want
    assert llm.llm_engine.runner._forward_decode_fns  # decode steps ran decode-only programs
    # Their layers traced the kernel and never the attention alone; the mixed programs the reference.
    assert "rope_write" in seen and True not in seen and False in seen


def test_rope_write_backend_equals_rotate_then_attend():
    """At the backend: attend(..., rope=...) with the one-launch kernel (decode-only programs)
    gives what the mixed backend gives (XLA's rotation, write_kv, the attention), on one device
    and under a mesh."""
    from jax.sharding import Mesh

    from jaxengine.models.attention import AttentionMetadata
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.layers import RotaryEmbedding
    from tests.kernels.test_decode_rope_write import _case

    n, k, h = 8, 2, 64
    b, qkv, kc, vc, slots, _, _ = _case(np.random.default_rng(2), ctx_lens=[4, 30, 17], n=n, k=k, h=h, p=16,
                                        dtype=jnp.float32)
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=n * h, intermediate_size=64, num_layers=1, num_heads=n,
                      num_kv_heads=k, head_dim=h, rope_theta=500.0)
    rope = RotaryEmbedding(cfg)
    positions = jnp.asarray(b.kv_lens - 1)[jnp.minimum(jnp.arange(qkv.shape[0]), len(b.kv_lens) - 1)]
    md = AttentionMetadata(slots, b.kv_lens, b.block_tables, b.query_start_loc, b.num_seqs)
    fn = functools.partial(rpa_gpu.ragged_paged_attention_gpu, interpret=True)
    fused = functools.partial(rpa_gpu.decode_attention_rope_write, interpret=True)
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    live = 3
    for m in (None, mesh):
        mixed = AttentionBackend("pallas", "gpu", fn, mesh=m, decode_only_path=True, rope_write_fn=fused)
        decode = mixed.for_decode_only_steps()
        assert decode.fuses_rope_write and not mixed.fuses_rope_write
        outs = [be.attend(qkv[:, :n], qkv[:, n:n + k], qkv[:, n + k:], (kc, vc), md, sm_scale=0.125, rope=rope,
                          positions=positions) for be in (mixed, decode)]
        np.testing.assert_allclose(np.asarray(outs[1][0])[:live], np.asarray(outs[0][0])[:live], rtol=1e-5,
                                   atol=1e-5)
        for a, c in zip(outs[0][1], outs[1][1]):  # block 0: the mixed write's padding rows
            np.testing.assert_allclose(np.asarray(c)[1:], np.asarray(a)[1:], rtol=1e-6, atol=1e-6)
