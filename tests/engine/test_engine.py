"""Engine behaviour end to end on tiny random checkpoints (CPU): greedy output against transformers,
chunked prefill, prefix caching, preemption, sampling, stops, logprobs, and no compile after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxengine import LLM, SamplingParams, sampler
from jaxengine.compile_monitor import compile_count
from tests.tiny_checkpoints import load_reference

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "a",
    "In the beginning the Universe was created. This has made a lot of people very angry and been "
    "widely regarded as a bad move.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13",
    "Paris is the capital of",
    "def add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]
# warmup=True: every bucket compiled at start-up (test_no_compile_after_warmup checks none compiles later)
ENGINE_KW = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=128,
                 block_size=16, warmup=True)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)


def make_llm(path: str, cache: str, **kw) -> LLM:
    args = dict(ENGINE_KW)
    args.update(kw)
    return LLM(path, compilation_cache_dir=cache, **args)


def reference_greedy(ref, tokenizer, prompt: str, n: int) -> tuple[list[int], np.ndarray]:
    ids = tokenizer.encode(prompt)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)
    toks = out.sequences[0, len(ids):].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), -1).numpy()
    return toks, logprobs


def assert_close_greedy(ours, ref_toks: list[int], ref_logprobs: np.ndarray, k: int = 5) -> None:
    """Equal tokens, or at the first divergence each token is in the other's top-k."""
    got = ours.token_ids
    for i, (a, b) in enumerate(zip(got, ref_toks)):
        if a != b:
            ours_topk = set(ours.logprobs[i])
            ref_topk = set(np.argsort(-ref_logprobs[i])[:k].tolist())
            assert b in ours_topk and a in ref_topk, f"diverged at {i}: ours {a}, reference {b}"
            return
    assert len(got) == len(ref_toks)


# The families differ in their forward, which every family's numerics tests (greedy tokens and
# logprobs, prompt logprobs against transformers) check. The sampler, stops, logit edits, input
# checks, the runner's contract and the compiled program set are the engine's own: those tests run
# on llama and on gemma3 (the family least like it: sliding windows, soft caps, scaled embeddings),
# whose engines compile every bucket at start-up; the others compile what their tests use.
ENGINE_LEVEL_FAMILIES = ("llama", "gemma3")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral", "gpt2", "opt-post-ln",
                                        "gemma2", "gemma3"])
def family_llm(request, tiny_model_factory, xla_cache_dir):
    path = tiny_model_factory(request.param)
    return request.param, path, make_llm(path, xla_cache_dir, warmup=request.param in ENGINE_LEVEL_FAMILIES)


def engine_level(family: str) -> None:
    """Skips an engine-level test on the families that only check their numerics."""
    if family not in ENGINE_LEVEL_FAMILIES:
        pytest.skip("engine-level behaviour: checked on " + " and ".join(ENGINE_LEVEL_FAMILIES))


def test_greedy_matches_transformers_batch8(family_llm):
    family, path, llm = family_llm
    ref = load_reference(path)
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for prompt, out in zip(PROMPTS, outs):
        ref_toks, ref_lp = reference_greedy(ref, tok, prompt, 16)
        assert_close_greedy(out.outputs[0], ref_toks, ref_lp)
        # logprobs of the sampled tokens are transformers' log-softmax
        for i, t in enumerate(out.outputs[0].token_ids[:4]):
            assert abs(out.outputs[0].logprobs[i][t].logprob - ref_lp[i][t]) < 1e-3
        assert out.outputs[0].finish_reason == "length"
    # batch size 1 gives the same tokens as inside the batch of 8
    single = llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)[0]
    assert single.outputs[0].token_ids == outs[3].outputs[0].token_ids


def penalized_greedy(ref, ids: list[int], n: int, rep: float, presence: float, frequency: float) -> list[int]:
    """Greedy decoding of transformers' model with vLLM's penalties applied to its logits:
    repetition over prompt and output tokens, presence and frequency over output tokens."""
    seq, out = list(ids), []
    for _ in range(n):
        with torch.no_grad():
            logits = ref(torch.tensor([seq])).logits[0, -1].double().numpy()
        for t in set(seq):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(np.argmax(logits)))
        seq.append(out[-1])
    return out


def test_penalties_run_ahead_and_match_transformers(family_llm, monkeypatch):
    """Penalties read the output tokens, the newest of them still being sampled by the step in
    flight: the engine does not wait for it (the device fills it in), and greedy tokens equal
    transformers' logits with vLLM's penalties applied step by step."""
    name, path, llm = family_llm
    if name != "llama":
        pytest.skip("the sampler is shared by every family")
    ref = load_reference(path)
    tok = llm.get_tokenizer()
    runner = llm.llm_engine.runner
    ahead, in_flight = [], []
    monkeypatch.setattr(sampler, "in_flight_history_id",
                        lambda row, f=sampler.in_flight_history_id: in_flight.append(row) or f(row))
    dispatch = runner.dispatch
    runner.dispatch = lambda sched, prev=None: ahead.append(prev is not None) or dispatch(sched, prev)
    pen = dict(repetition_penalty=1.2, presence_penalty=1.5, frequency_penalty=0.7)
    # unpenalized, the tiny model repeats its last token after the first prompt (and often after
    # the last): a penalty that missed the token in flight would let it repeat
    prompts = [PROMPTS[7], PROMPTS[0], "1 1 1 1 1 1"]
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **pen),
                            use_tqdm=False)
    finally:
        runner.dispatch = dispatch
    assert sum(ahead) >= 10  # decode steps were scheduled while the step before was in flight
    assert len(in_flight) >= 10  # and their histories ended in the token still being sampled
    for prompt, out in zip(prompts, outs):
        want = penalized_greedy(ref, tok.encode(prompt), 12, *pen.values())
        assert out.outputs[0].token_ids == want


def test_chunked_prefill_equals_unchunked(tiny_model_factory, xla_cache_dir):
    path = tiny_model_factory("llama")
    long_prompts = [PROMPTS[3] * 2, PROMPTS[7], PROMPTS[0]]
    base = make_llm(path, xla_cache_dir).generate(long_prompts, GREEDY, use_tqdm=False)
    small = make_llm(path, xla_cache_dir, max_num_batched_tokens=16)
    chunked = small.generate(long_prompts, GREEDY, use_tqdm=False)
    assert len(small.get_tokenizer().encode(long_prompts[0])) > 16  # really chunked
    assert [o.outputs[0].token_ids for o in chunked] == [o.outputs[0].token_ids for o in base]


def test_prefix_caching_on_equals_off_and_hits(tiny_model_factory, xla_cache_dir):
    path = tiny_model_factory("llama")
    shared = PROMPTS[3] + " " + PROMPTS[7]
    prompts = [shared + " one", shared + " two", shared + " three"]
    on = make_llm(path, xla_cache_dir)
    first = on.generate(prompts[0], GREEDY, use_tqdm=False)
    hits_before = on.llm_engine.stats()["prefix_cache_hits"]
    rest = on.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert on.llm_engine.stats()["prefix_cache_hits"] > hits_before
    assert rest[0].num_cached_tokens and rest[0].num_cached_tokens >= 16
    off = make_llm(path, xla_cache_dir, enable_prefix_caching=False)
    ref = off.generate(prompts, GREEDY, use_tqdm=False)
    assert off.llm_engine.stats()["prefix_cache_hits"] == 0
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in ref]


def test_preemption_gives_identical_outputs(tiny_model_factory, xla_cache_dir):
    path = tiny_model_factory("llama")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:6]
    big = make_llm(path, xla_cache_dir).generate(prompts, params, use_tqdm=False)
    tight = make_llm(path, xla_cache_dir, num_kv_blocks=17, max_num_seqs=8)
    small = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in big]
    assert tight.llm_engine.scheduler.block_manager.num_free_blocks == 16  # nothing leaked


def test_seeded_sampling_reproducible_and_n(family_llm):
    name, _, llm = family_llm
    engine_level(name)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    a = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids
    # same seed inside a different batch composition -> same tokens
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                         [SamplingParams(max_tokens=5, temperature=0.7), p, GREEDY], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == a
    b = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=99), use_tqdm=False)
    assert b[0].outputs[0].token_ids != a
    multi = llm.generate(PROMPTS[0], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7), use_tqdm=False)[0]
    assert [c.index for c in multi.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in multi.outputs}) == 3
    assert all(len(c.token_ids) == 8 for c in multi.outputs)


def test_stop_strings_and_token_limits(family_llm):
    name, _, llm = family_llm
    engine_level(name)
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    text = base[0].outputs[0].text
    # three characters from the middle on, the first such window that is not all whitespace
    at = next(i for i in range(len(text) // 2, len(text) - 2) if text[i:i + 3].strip())
    stop = text[at:at + 3]
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0, stop=[stop], ignore_eos=True,
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    # stop token ids, min_tokens and max_tokens
    first = base[0].outputs[0].token_ids[0]
    st = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[first]),
                      use_tqdm=False)[0].outputs[0]
    assert st.token_ids == [first] and st.finish_reason == "stop" and st.stop_reason == first
    mt = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[first], min_tokens=4),
                      use_tqdm=False)[0].outputs[0]
    assert len(mt.token_ids) >= 4 and first not in mt.token_ids[:4]
    short = llm.generate(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(short[0].outputs[0].token_ids) == 3 and short[0].outputs[0].finish_reason == "length"


def test_stop_strings_in_a_batch_trim_exactly(family_llm):
    """Stop strings are found on the output worker while later steps are already in flight (the
    other rows keep the steps overlapping): each request still ends at the token that completed
    its stop, with the text and token ids that processing in the loop gives; the tokens sampled
    after it are dropped."""
    from jaxengine.detokenizer import IncrementalDetokenizer

    name, _, llm = family_llm
    engine_level(name)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = llm.generate(PROMPTS, greedy, use_tqdm=False)
    params, want = [], []
    for out in base:
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        at = next((i for i in range(len(text) // 3, len(text) - 2) if text[i:i + 3].strip()), None)
        if at is None:  # too little text for a stop string: runs to its length
            params.append(greedy)
            want.append((text, ids, "length"))
            continue
        sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[text[at:at + 3]])
        detok = IncrementalDetokenizer(llm.get_tokenizer(), out.prompt_token_ids, sp)
        k = next(i for i, t in enumerate(ids) if detok.update_one(t) is not None)
        params.append(sp)
        want.append((detok.output_text, ids[:k + 1], "stop"))
    assert sum(w[2] == "stop" for w in want) >= 4
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, (text, ids, reason) in zip(outs, want):
        c = out.outputs[0]
        assert (c.text, c.token_ids, c.finish_reason) == (text, ids, reason)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == llm.llm_engine.scheduler.block_manager.num_usable_blocks


def test_no_compile_after_warmup(family_llm):
    name, _, llm = family_llm
    engine_level(name)
    before = compile_count()
    workload = [
        (PROMPTS, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=1)),
        ([PROMPTS[3] * 3], SamplingParams(max_tokens=5, temperature=0)),
        (PROMPTS[:3], SamplingParams(max_tokens=10, repetition_penalty=1.3, presence_penalty=0.5,
                                     frequency_penalty=0.2, logprobs=3)),
        ([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(n=4, max_tokens=6, min_p=0.1)),
        (PROMPTS[:2], SamplingParams(max_tokens=6, logit_bias={5: 3.0}, allowed_token_ids=list(range(5, 60)),
                                     bad_words=["the"])),
    ]
    for prompts, params in workload:
        llm.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before


def test_logit_edits_and_prompt_truncation(family_llm):
    """logit_bias, allowed_token_ids and bad_words (one token and several) steer what is sampled,
    in greedy and random rows of one batch; truncate_prompt_tokens keeps the prompt's tail."""
    name, _, llm = family_llm
    engine_level(name)
    tok = llm.get_tokenizer()
    base = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    first = base[0].outputs[0].token_ids
    allowed = sorted(set(first[:3]) | {11, 12})
    forced, restricted, sampled = llm.generate(
        PROMPTS[:3], [SamplingParams(max_tokens=6, temperature=0, logit_bias={13: 100.0}),
                      SamplingParams(max_tokens=6, temperature=0, allowed_token_ids=allowed),
                      SamplingParams(max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=allowed)],
        use_tqdm=False)
    assert forced.outputs[0].token_ids == [13] * 6
    assert set(restricted.outputs[0].token_ids) <= set(allowed)
    assert set(sampled.outputs[0].token_ids) <= set(allowed)
    # a two-token bad word taken from the greedy output: it never appears again
    word = tok.decode(first[1:3])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words=[word])
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    for seq in params.bad_words_token_ids or [first[1:3]]:
        assert all(out[i:i + len(seq)] != seq for i in range(len(out))), (seq, out)
    assert out[:1] == first[:1]  # the output before the word is unchanged
    ids = tok.encode(PROMPTS[3])
    trunc = llm.generate(PROMPTS[3], SamplingParams(max_tokens=2, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert trunc.prompt_token_ids == ids[-3:]
    with pytest.raises(ValueError, match="allowed_token_ids has token ids out of vocabulary"):
        llm.generate("x", SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={"x": 1.0})


def test_bad_inputs(family_llm):
    name, _, llm = family_llm
    engine_level(name)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": list(range(300))}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**7]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate("x", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate("x", SamplingParams(n=9), use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["x"], [GREEDY, GREEDY], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # the engine still serves after rejected input
    assert len(llm.generate("ok", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_engine_arguments_validated():
    for kw, msg in [(dict(block_size=12), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
                    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                    (dict(dtype="int4"), "dtype"), (dict(load_format="pickle"), "load_format"),
                    (dict(distributed_executor_backend="mp"), "command line"),
                    (dict(distributed_executor_backend="ray"), "distributed_executor_backend")]:
        with pytest.raises(ValueError, match=msg):
            LLM(**kw)


def test_prompt_logprobs_match_transformers(family_llm):
    family, path, llm = family_llm
    ref = load_reference(path)
    prompt = PROMPTS[3]
    out = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1).numpy()
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert ids[pos] in entry and len(entry) in (3, 4)
        assert abs(entry[ids[pos]].logprob - want[pos - 1, ids[pos]]) < 1e-3, (family, pos)
        best = max(entry.values(), key=lambda lp: lp.logprob)
        assert best.rank == 1 and abs(best.logprob - want[pos - 1].max()) < 1e-3


def test_runner_reads_only_the_scheduler_output(family_llm):
    """The model runner's whole input is a SchedulerOutput of plain rows: a step built by hand,
    with no Request in it, samples the greedy token that LLM.generate gives for the prompt."""
    from jaxengine.request import Request, RequestSpec
    from jaxengine.scheduler import ScheduledSeq, SchedulerOutput

    name, _, llm = family_llm
    engine_level(name)
    eng = llm.llm_engine
    ids = eng.tokenize(PROMPTS[2])
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    want = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    bm = eng.scheduler.block_manager
    holder = Request("blocks-for-the-hand-built-step", ids, greedy)  # only to take KV blocks from the pool
    assert bm.allocate_slots(holder, len(ids))
    try:
        row = ScheduledSeq("hand-built", 0, len(ids), ids, bm.get_block_ids(holder.request_id), True,
                           RequestSpec(greedy, 0, ids), None)
        out = eng.runner.execute(SchedulerOutput([row], len(ids), [], []))
    finally:
        bm.free(holder)
    assert out.token_ids.tolist() == want


def test_profiled_step_bytes(family_llm):
    """The KV-sizing profile reads XLA's buffer analysis of the largest bucket."""
    from jaxengine.model_runner import profile_step_bytes

    name, _, llm = family_llm
    engine_level(name)
    eng = llm.llm_engine
    r = eng.runner
    got = profile_step_bytes(eng.config, eng.model_config, r.graphdef, r.state, r.dtype, r.plan, r.attention)
    # at least the float32 logits of the largest bucket's rows
    assert got is not None and got >= 4 * min(64, 8) * eng.model_config.vocab_size


def test_nan_logits_fail_only_their_request(tiny_model_factory, xla_cache_dir):
    """A request whose logits turn NaN (here: a poisoned embedding row it uses) ends alone with
    finish_reason "error"; the others in the same batches finish with their solo outputs."""
    import jax
    import jax.numpy as jnp

    path = tiny_model_factory("llama")
    llm = make_llm(path, xla_cache_dir)
    eng = llm.llm_engine
    good = [{"prompt_token_ids": [11, 12, 13, 14]}, {"prompt_token_ids": [21, 22, 23]}]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    solo = [o.outputs[0].token_ids for o in llm.generate(good, params, use_tqdm=False)]
    runner = eng.runner
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(runner.state)[0]]
    idx = next(i for i, p in enumerate(paths) if "embed_tokens" in jax.tree_util.keystr(p))
    leaves = list(runner.param_leaves)
    leaves[idx] = leaves[idx].at[777].set(jnp.nan)
    runner.param_leaves = tuple(leaves)
    outs = llm.generate([good[0], {"prompt_token_ids": [5, 6, 777]}, good[1]], params, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "NaN" in eng.request_errors.pop(outs[1].request_id)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == solo
    assert eng.scheduler.block_manager.num_free_blocks == eng.config.num_kv_blocks - 1


def test_sliding_window_frees_blocks_and_keeps_outputs(tiny_model_factory, xla_cache_dir):
    """Every layer of the tiny Mistral attends within 24 positions: while a long request decodes,
    its blocks before the window go back to the pool (the table holds null entries there), and
    its greedy tokens still equal transformers'."""
    path = tiny_model_factory("mistral")
    llm = make_llm(path, xla_cache_dir)
    eng = llm.llm_engine
    bm = eng.scheduler.block_manager
    assert bm.sliding_window == 24 and eng.model_config.kv_window == 24
    ids = [int(t) for t in np.random.default_rng(3).integers(100, 40000, 100)]
    ref = load_reference(path)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, pad_token_id=0)[0, 100:].tolist()
    eng.add_request("long", {"prompt_token_ids": ids}, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    held, nulls, final = [], 0, None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final = out
        table = bm.tables.get("long")
        if table is not None:
            held.append(sum(b != 0 for b in table))
            nulls = max(nulls, table.count(0))
    assert final.outputs[0].token_ids == want
    # 148 positions in blocks of 16 would take 10 blocks; the window needs 24 positions, at most
    # 3 blocks, plus the block being filled
    assert nulls >= 6 and held[-1] <= 4
    bm.check_invariants()
    assert bm.num_free_blocks == eng.config.num_kv_blocks - 1
