"""The on-device sampler against numpy references, on CPU with small vocabularies.

Many draws come from one call: rows share logits and seed but differ in `steps`, so each row
is an independent draw from the same distribution.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.sampler import (
    MAX_BANNED_IDS,
    SamplingMetadata,
    SamplingRow,
    apply_penalties,
    build_sampling_metadata,
    lean_mode,
    needs_processors,
    sample,
    top_k_two_stage,
)
from jaxengine.sampling_params import MAX_LOGPROBS, SamplingParams

V = 64
DRAWS = 4000

R = 8  # one bucket for most tests, so few programs compile
HIST = 32
_sample = jax.jit(sample, static_argnames=("use_processors",))


def _run(rows, logits, use_processors=False, num_rows=R):
    """Samples `rows` padded to `num_rows`; padding logits are zeros."""
    logits = np.asarray(logits, np.float32)
    full = np.zeros((num_rows, logits.shape[-1]), np.float32)
    full[: logits.shape[0]] = logits
    return _sample(full, build_sampling_metadata(rows, num_rows, HIST), use_processors=use_processors)


def _row(params: SamplingParams, seed: int = 0, step: int = 0, prompt=(1, 2, 3), output=(), eos=()) -> SamplingRow:
    return SamplingRow(params, seed, step, list(prompt), list(output), tuple(eos))


def _logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _many_draws(params: SamplingParams, logits_row: np.ndarray, seed: int = 1234) -> np.ndarray:
    """DRAWS independent samples of one distribution: same seed, steps 0..DRAWS-1."""
    rows = [_row(params, seed=seed, step=s) for s in range(DRAWS)]
    logits = np.broadcast_to(logits_row, (DRAWS, logits_row.shape[-1]))
    return np.asarray(_run(rows, logits, num_rows=DRAWS).token_ids)


def _check_distribution(tokens: np.ndarray, expected: np.ndarray) -> None:
    allowed = np.flatnonzero(expected > 0)
    assert np.isin(tokens, allowed).all(), f"sampled outside the allowed set {allowed}: {np.setdiff1d(tokens, allowed)}"
    freq = np.bincount(tokens, minlength=expected.shape[0]) / tokens.shape[0]
    # 4000 draws: binomial std <= 0.008; 0.035 is > 4 sigma.
    np.testing.assert_allclose(freq, expected, atol=0.035)


# -- host metadata ---------------------------------------------------------------------------
def test_metadata_pads_with_neutral_greedy_rows():
    rows = [_row(SamplingParams(temperature=0.7, top_p=0.5, top_k=5, min_p=0.1, seed=9), seed=9, step=3),
            _row(SamplingParams(temperature=1e-6))]
    md = build_sampling_metadata(rows, 4, 16)
    np.testing.assert_array_equal(md.temperature, np.float32([0.7, 0.0, 0.0, 0.0]))
    np.testing.assert_array_equal(md.top_p, np.float32([0.5, 1, 1, 1]))
    np.testing.assert_array_equal(md.top_k, [5, 0, 0, 0])
    np.testing.assert_array_equal(md.min_p, np.float32([0.1, 0, 0, 0]))
    np.testing.assert_array_equal(md.repetition_penalty, np.float32([1, 1, 1, 1]))
    np.testing.assert_array_equal(md.seeds, [9, 0, 0, 0])
    np.testing.assert_array_equal(md.steps, [3, 0, 0, 0])
    assert md.seeds.dtype == np.uint32 and md.steps.dtype == np.int32
    assert md.history.shape == (4, 16) and (md.history == -1).all()  # no penalties: history unused
    assert md.banned_ids.shape == (4, MAX_BANNED_IDS) and (md.banned_ids == -1).all()
    empty = build_sampling_metadata([], 2, 1)
    assert empty.history.shape == (2, 1) and (empty.temperature == 0).all()


def test_metadata_history_and_truncation():
    pen = SamplingParams(repetition_penalty=1.3)
    rows = [_row(pen, prompt=[5, 6], output=[7]), _row(SamplingParams()),
            _row(pen, prompt=[1, 2, 3, 4], output=[8, 9, 10])]
    md = build_sampling_metadata(rows, 4, 5)
    np.testing.assert_array_equal(md.history[0], [5, 6, 7, -1, -1])
    np.testing.assert_array_equal(md.history[1], [-1] * 5)  # row without penalties: not filled
    np.testing.assert_array_equal(md.history[2], [3, 4, 8, 9, 10])  # the newest tokens kept
    np.testing.assert_array_equal(md.num_prompt, [2, 0, 2, 0])


def test_metadata_validation():
    with pytest.raises(ValueError, match="do not fit"):
        build_sampling_metadata([_row(SamplingParams())] * 3, 2, 1)
    with pytest.raises(ValueError, match="history_len"):
        build_sampling_metadata([], 2, 0)


def test_seeds_wrap_to_uint32():
    md = build_sampling_metadata([_row(SamplingParams(), seed=2**40 + 5), _row(SamplingParams(), seed=-1)], 2, 1)
    np.testing.assert_array_equal(md.seeds, np.uint32([5, 2**32 - 1]))


def test_needs_processors():
    assert not needs_processors([SamplingParams(), SamplingParams(temperature=0)])
    assert needs_processors([SamplingParams(), SamplingParams(presence_penalty=0.5)])
    assert needs_processors([SamplingParams(frequency_penalty=-0.1)])
    assert needs_processors([SamplingParams(repetition_penalty=1.1)])
    assert not needs_processors([])


# -- greedy, logprobs, padding -------------------------------------------------------------
@pytest.mark.parametrize("use_processors", [False, True])
def test_greedy_is_argmax_and_logprobs_are_raw(use_processors):
    logits = _logits(8, seed=1)
    rows = [_row(SamplingParams(temperature=0)) for _ in range(5)]
    out = _run(rows, logits, use_processors)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(out.logprob, ref[np.arange(8), logits.argmax(-1)], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out.rank, 1)
    order = np.argsort(-ref, axis=-1)[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, order, -1), rtol=1e-6, atol=1e-6)
    assert out.top_ids.shape == (8, MAX_LOGPROBS) and out.top_ids.dtype == jnp.int32


def test_lean_forms_draw_the_full_samplers_tokens_and_compute_no_logprobs():
    """The lean forms (no row asks for logprobs) return the full sampler's tokens, zeros for the
    logprob and rank and no top logprobs; "greedy" only for all-greedy rows. A bitmask or the
    processors refuse them."""
    lean_sample = jax.jit(sample, static_argnames=("use_processors", "truncate", "lean"))
    logits = _logits(R, seed=30)
    sampled = [_row(SamplingParams(temperature=0.8, top_p=0.9), seed=i, step=i) for i in range(3)]
    greedy = [_row(SamplingParams(temperature=0)) for _ in range(3)]
    for rows, lean, truncate in ((sampled + greedy, "sample", True), (greedy, "greedy", False),
                                 (greedy, "sample", False)):
        md = build_sampling_metadata(rows, R, HIST)
        full = lean_sample(logits, md, use_processors=False, truncate=truncate)
        out = lean_sample(logits, md, use_processors=False, truncate=truncate, lean=lean)
        np.testing.assert_array_equal(out.token_ids, full.token_ids)
        assert out.top_ids.shape == (R, 0) and out.top_logprobs.shape == (R, 0)
        assert not np.asarray(out.logprob).any() and not np.asarray(out.rank).any()
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    with pytest.raises(ValueError, match="lean"):
        sample(logits, build_sampling_metadata(greedy, R, HIST), use_processors=True, lean="greedy")
    with pytest.raises(ValueError, match="lean"):
        sample(logits, build_sampling_metadata(greedy, R, HIST), use_processors=False, lean="fast")


def test_lean_mode():
    assert lean_mode([SamplingParams(temperature=0), SamplingParams(temperature=0, max_tokens=3)]) == "greedy"
    assert lean_mode([SamplingParams(temperature=0), SamplingParams(temperature=0.7)]) == "sample"
    assert lean_mode([SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=0)]) is None
    assert lean_mode([SamplingParams(temperature=1.0, logprobs=3)]) is None
    assert lean_mode([]) == "greedy"


@pytest.mark.parametrize("vocab", [8192, 8000 + 37])  # two-stage path, with a ragged last block
def test_two_stage_top_k_matches_lax_top_k(vocab):
    x = _logits(3, vocab, seed=20)
    x[1, 5000:5030] = 9.0  # many ties at the top, spread over blocks
    x[2, :] = -1.0
    x[2, [7, vocab - 1]] = 3.0  # the maximum in the ragged last block
    values, ids = jax.jit(top_k_two_stage, static_argnums=1)(x, MAX_LOGPROBS)
    ref_values, _ = jax.lax.top_k(x, MAX_LOGPROBS)
    np.testing.assert_array_equal(values, ref_values)
    np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(ids), -1), values)  # ids point at them
    assert all(np.unique(np.asarray(row)).size == MAX_LOGPROBS for row in ids)  # no id twice


def test_logprob_and_rank_of_random_samples_use_raw_logits():
    logits = _logits(6, seed=2)
    params = SamplingParams(temperature=1.7, top_k=7, repetition_penalty=1.5, presence_penalty=1.0)
    rows = [_row(params, seed=s, output=[3, 4]) for s in range(6)]
    out = _run(rows, logits, use_processors=True)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    tok = np.asarray(out.token_ids)[:6]
    np.testing.assert_allclose(out.logprob[:6], ref[np.arange(6), tok], rtol=1e-6, atol=1e-6)
    expected_rank = 1 + (ref > ref[np.arange(6), tok][:, None]).sum(-1)
    np.testing.assert_array_equal(out.rank[:6], expected_rank)


def test_padding_rows_change_nothing():
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_k=3, min_p=0.05, seed=2)]
    rows = [_row(p, seed=i + 10, step=i) for i, p in enumerate(params)]
    logits = _logits(R, seed=3)
    logits[3:] *= 50
    small = _run(rows, logits)
    big = _run(rows, logits[:3], num_rows=DRAWS)
    np.testing.assert_array_equal(big.token_ids[:3], small.token_ids[:3])
    np.testing.assert_array_equal(small.token_ids[3:], logits[3:].argmax(-1))  # padding rows = greedy
    assert int(small.token_ids[1]) == logits[1].argmax()  # a greedy row among random ones


# -- penalties -------------------------------------------------------------------------------
def _penalties_reference(logits, prompt, output, rep, freq, pres):
    out = logits.astype(np.float64).copy()
    seen = np.zeros(out.shape[0], bool)
    seen[list(prompt) + list(output)] = True
    out[seen] = np.where(out[seen] > 0, out[seen] / rep, out[seen] * rep)
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=out.shape[0])
    out -= freq * counts
    out -= pres * (counts > 0)
    return out


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(5)
    logits = _logits(4, seed=6)
    cases = [(1.3, 0.5, 0.7), (0.8, -0.4, 0.0), (1.0, 0.0, 2.0), (1.0, 0.0, 0.0)]
    rows, histories = [], []
    for rep, freq, pres in cases:
        prompt = rng.integers(0, V, 6).tolist()
        output = rng.integers(0, V, 9).tolist() + [prompt[0]] * 3  # repeats, and prompt tokens reused
        histories.append((prompt, output))
        rows.append(_row(SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
                         prompt=prompt, output=output))
    md = build_sampling_metadata(rows, 4, HIST)
    got = np.asarray(jax.jit(apply_penalties)(logits, md))
    for i, (rep, freq, pres) in enumerate(cases):
        ref = _penalties_reference(logits[i], *histories[i], rep, freq, pres)
        np.testing.assert_allclose(got[i], ref, rtol=1e-5, atol=1e-5)


def test_greedy_with_penalties_takes_argmax_of_penalised_logits():
    logits = np.zeros((2, V), np.float32)
    logits[:, 10] = 3.0  # favourite, already repeated in the output
    logits[:, 11] = 2.5
    params = SamplingParams(temperature=0, frequency_penalty=0.4)
    rows = [_row(params, output=[10, 10]), _row(SamplingParams(temperature=0), output=[10, 10])]
    out = _run(rows, logits, use_processors=True)
    np.testing.assert_array_equal(out.token_ids[:2], [11, 10])  # 3.0 - 0.8 < 2.5; row 1 unpenalised


# -- truncation: never outside the allowed set, frequencies as renormalised -----------------
def test_plain_temperature_sampling_matches_softmax():
    logits = _logits(1, seed=7, scale=1.0)[0]
    tokens = _many_draws(SamplingParams(temperature=0.5), logits)
    _check_distribution(tokens, _softmax(logits / 0.5))


def test_top_k():
    logits = _logits(1, seed=8, scale=1.0)[0]
    k = 5
    expected = _softmax(logits)
    expected[np.argsort(-logits)[k:]] = 0
    tokens = _many_draws(SamplingParams(top_k=k), logits)
    _check_distribution(tokens, expected / expected.sum())


def test_top_p():
    logits = _logits(1, seed=9, scale=1.5)[0]
    top_p = 0.6
    probs = _softmax(logits)
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    kept = order[before < top_p]
    assert 1 < kept.size < V
    expected = np.zeros_like(probs)
    expected[kept] = probs[kept]
    tokens = _many_draws(SamplingParams(top_p=top_p), logits)
    _check_distribution(tokens, expected / expected.sum())


def test_top_p_always_keeps_one_token():
    logits = _logits(1, seed=10)[0]
    tokens = _many_draws(SamplingParams(top_p=1e-6), logits)[:200]
    assert (tokens == logits.argmax()).all()


def test_min_p():
    logits = _logits(1, seed=11, scale=1.5)[0]
    min_p = 0.2
    probs = _softmax(logits)
    expected = np.where(probs >= min_p * probs.max(), probs, 0)
    assert 1 < (expected > 0).sum() < V
    tokens = _many_draws(SamplingParams(min_p=min_p), logits)
    _check_distribution(tokens, expected / expected.sum())


def test_top_k_top_p_min_p_combined_with_temperature():
    logits = _logits(1, seed=12, scale=1.0)[0]
    t, k, p, m = 0.7, 12, 0.8, 0.1
    probs = _softmax(logits / t)
    order = np.argsort(-probs)
    probs_k = np.zeros_like(probs)
    probs_k[order[:k]] = probs[order[:k]]
    probs_k /= probs_k.sum()
    before = np.cumsum(probs_k[order]) - probs_k[order]
    keep = order[(before < p) & (np.arange(V) < k)]
    expected = np.zeros_like(probs)
    expected[keep] = probs_k[keep]
    expected = np.where(expected >= m * expected.max(), expected, 0)
    tokens = _many_draws(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m), logits)
    _check_distribution(tokens, expected / expected.sum())


def test_truncation_rows_do_not_affect_untruncated_rows():
    # One row needs the sort (top_k), the other does not: the other must still see every token.
    logits = _logits(1, seed=13, scale=0.5)[0]
    rows = [_row(SamplingParams(top_k=2), seed=1, step=s) if s % 2 == 0 else _row(SamplingParams(), seed=1, step=s)
            for s in range(DRAWS)]
    out = np.asarray(_run(rows, np.broadcast_to(logits, (DRAWS, V)), num_rows=DRAWS).token_ids)
    assert np.isin(out[0::2], np.argsort(-logits)[:2]).all()
    assert np.unique(out[1::2]).size > 30  # near-flat distribution over 64 tokens


# -- seeds -----------------------------------------------------------------------------------
def test_same_seed_and_step_same_token_in_any_batch():
    vocab = 1000
    # Flat logits: the token is decided by the noise alone.
    target = _row(SamplingParams(temperature=1.0, seed=42), seed=42, step=7)
    others = [_row(SamplingParams(temperature=0.9, top_p=0.5), seed=s, step=s) for s in range(6)]
    a = _run([target], np.zeros((1, vocab)))
    b_rows = others[:3] + [target] + others[3:]
    b = _run(b_rows, np.zeros((7, vocab)), use_processors=True)
    assert int(a.token_ids[0]) == int(b.token_ids[3])
    c = _run([target._replace(step=8)], np.zeros((1, vocab)))
    assert int(c.token_ids[0]) != int(a.token_ids[0])  # the step moves the key (1/1000 chance of a tie)


def test_different_seeds_differ():
    vocab = 1000
    tokens = []
    for first in range(0, 32, R):
        rows = [_row(SamplingParams(seed=s), seed=s, step=0) for s in range(first, first + R)]
        tokens.extend(np.asarray(_run(rows, np.zeros((R, vocab))).token_ids).tolist())
    assert len(set(tokens)) > 25


# -- min_tokens bans -------------------------------------------------------------------------
def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = np.zeros((3, V), np.float32)
    logits[:, 2] = 9.0  # eos is the favourite
    logits[:, 7] = 8.0  # then a stop id
    logits[:, 5] = 7.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7])
    rows = [_row(p, step=1, eos=[2]), _row(p, step=3, eos=[2]),
            _row(SamplingParams(temperature=0, min_tokens=3, ignore_eos=True), step=0, eos=[2])]
    md = build_sampling_metadata(rows, 3, 1)
    np.testing.assert_array_equal(md.banned_ids[0, :2], [2, 7])
    np.testing.assert_array_equal(md.banned_ids[1:], -1)
    out = _run(rows, logits)
    np.testing.assert_array_equal(out.token_ids[:3], [5, 2, 2])
    np.testing.assert_array_equal(out.rank[:3], [3, 1, 1])  # ranks stay those of the raw logits


def test_sampler_output_is_a_pytree_of_arrays():
    md = build_sampling_metadata([], R, HIST)
    assert isinstance(md, SamplingMetadata)
    leaves = jax.tree_util.tree_leaves(md)
    assert len(leaves) == 18 and all(isinstance(x, np.ndarray) for x in leaves)
    out = _sample(_logits(R), md, use_processors=False)
    assert len(jax.tree_util.tree_leaves(out)) == 5


# -- logit edits: logit_bias, allowed_token_ids, bad_words ----------------------------------
def _with_bad_words(params: SamplingParams, words: list[list[int]]) -> SamplingParams:
    """params with bad words already tokenized to `words` (as update_from_tokenizer leaves them)."""
    params.__dict__["_bad_words_token_ids"] = words
    return params


def test_needs_processors_for_logit_edits():
    assert needs_processors([SamplingParams(logit_bias={3: 1.0})])
    assert needs_processors([SamplingParams(allowed_token_ids=[1, 2])])
    assert needs_processors([SamplingParams(bad_words=["x"])])
    plain = build_sampling_metadata([_row(SamplingParams())], R, 1)
    assert plain.bias_ids.shape == (R, 1) and plain.allowed_ids.shape == (R, 1) and plain.bad_last.shape == (R, 1)
    full = build_sampling_metadata([_row(SamplingParams(logit_bias={3: 1.0}))], R, HIST)
    assert full.bias_ids.shape[1] > 1 and full.allowed_ids.shape[1] > 1


def test_logit_bias_moves_greedy_but_not_logprobs():
    logits = _logits(2)
    target = int(np.argmin(logits[0]))
    rows = [_row(SamplingParams(temperature=0, logit_bias={target: 100.0})), _row(SamplingParams(temperature=0))]
    out = _run(rows, logits, use_processors=True)
    assert int(out.token_ids[0]) == target
    assert int(out.token_ids[1]) == int(np.argmax(logits[1]))  # a row without bias is untouched
    raw = logits[0] - np.log(np.exp(logits[0]).sum())
    np.testing.assert_allclose(float(out.logprob[0]), raw[target], rtol=1e-5)  # logprobs stay raw
    banned = int(np.argmax(logits[1]))
    out = _run([_row(SamplingParams(temperature=0, logit_bias={banned: -100.0}))], logits[1:], use_processors=True)
    assert int(out.token_ids[0]) != banned


def test_allowed_token_ids_restrict_greedy_and_random():
    logits = _logits(1)[0]
    allowed = [int(t) for t in np.argsort(logits)[:3]]  # the three least likely
    out = _run([_row(SamplingParams(temperature=0, allowed_token_ids=allowed))], logits[None], use_processors=True)
    assert int(out.token_ids[0]) == allowed[int(np.argmax(logits[allowed]))]
    rows = [_row(SamplingParams(allowed_token_ids=allowed), seed=9, step=s) for s in range(R)]
    out = _run(rows, np.broadcast_to(logits, (R, V)), use_processors=True)
    assert set(np.asarray(out.token_ids).tolist()) <= set(allowed)


def test_bad_words_one_token_always_and_longer_words_after_their_prefix():
    logits = np.zeros((1, V), np.float32)
    logits[0, 7], logits[0, 9] = 5.0, 4.0  # greedy picks 7, then 9
    one = _with_bad_words(SamplingParams(temperature=0, bad_words=["a"]), [[7]])
    assert int(_run([_row(one)], logits, use_processors=True).token_ids[0]) == 9
    two = _with_bad_words(SamplingParams(temperature=0, bad_words=["a b"]), [[4, 5, 7]])
    # 7 is banned only when the output so far ends with 4, 5 (in the output, not the prompt)
    cases = {(): 7, (4, 5): 9, (1, 4, 5): 9, (5,): 7, (4, 5, 1): 7}
    for output, want in cases.items():
        out = _run([_row(two, step=len(output), output=output)], logits, use_processors=True)
        assert int(out.token_ids[0]) == want, output
    out = _run([_row(two, prompt=(1, 4, 5), output=())], logits, use_processors=True)
    assert int(out.token_ids[0]) == 7  # the prefix in the prompt does not count
    assert two.reads_history and not one.reads_history


# -- structured outputs: the token bitmask -----------------------------------------------------
def _bitmask(allowed_per_row: list[list[int] | None], vocab: int = V) -> np.ndarray:
    """numpy reference packing: bit t % 32 of word t // 32 set when t is allowed (None: all)."""
    words = -(-vocab // 32)
    mask = np.zeros((len(allowed_per_row), words), np.uint32)
    for i, allowed in enumerate(allowed_per_row):
        if allowed is None:
            mask[i] = 0xFFFFFFFF
        for t in allowed or ():
            mask[i, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return mask.view(np.int32)


def test_bitmask_restricts_greedy_and_random_rows_and_keeps_raw_logprobs():
    logits = _logits(R)
    allowed = [[3, 40, 63], None, [31, 32], [0]] + [None] * (R - 4)
    rows = [_row(SamplingParams(temperature=0)), _row(SamplingParams(temperature=0)),
            _row(SamplingParams(temperature=1.0, seed=1)), _row(SamplingParams(temperature=1.5, top_p=0.9, seed=2))]
    md = build_sampling_metadata(rows, R, HIST, mask_words=2)
    md.bitmask = _bitmask(allowed)
    out = jax.jit(sample, static_argnames=("use_processors", "use_bitmask"))(
        logits, md, use_processors=False, use_bitmask=True)
    tokens = np.asarray(out.token_ids)
    assert tokens[0] == max([3, 40, 63], key=lambda t: logits[0, t])
    assert tokens[1] == int(np.argmax(logits[1]))  # an all-ones row is unconstrained
    assert tokens[2] in (31, 32) and tokens[3] == 0
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(np.asarray(out.logprob)[:4], logits[np.arange(4), tokens[:4]] - lse[:4], rtol=1e-5)


def test_bitmask_draws_follow_the_renormalised_distribution():
    logits = np.broadcast_to(_logits(1, seed=5), (R, V)).copy()
    allowed = [1, 7, 33, 50]
    counts = np.zeros(V)
    fn = jax.jit(sample, static_argnames=("use_processors", "use_bitmask"))
    for k in range(DRAWS // R):
        rows = [_row(SamplingParams(temperature=1.0, seed=9), step=k * R + s) for s in range(R)]
        md = build_sampling_metadata(rows, R, HIST, mask_words=2)
        md.bitmask = _bitmask([allowed] * R)
        np.add.at(counts, np.asarray(fn(logits, md, use_processors=False, use_bitmask=True).token_ids), 1)
    assert counts[[t for t in range(V) if t not in allowed]].sum() == 0
    expected = _softmax(logits[0, allowed]) * counts.sum()
    chi2 = (((counts[allowed] - expected) ** 2) / expected).sum()
    assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


@pytest.mark.parametrize("case", ["greedy", "random", "truncating"])
def test_static_truncation_variants_equal_the_device_decided_sampler(case):
    """The variants without lax.cond (truncate=True / False, chosen on the host) sample exactly
    what the device-decided sampler (truncate=None) samples."""
    params = {"greedy": [SamplingParams(temperature=0)] * 3,
              "random": [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=4),
                         SamplingParams(temperature=1.3, min_p=0.1, seed=5)],
              "truncating": [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_p=0.8, seed=6),
                             SamplingParams(temperature=1.0, top_k=5, seed=7)]}[case]
    from jaxengine.sampler import needs_truncation

    truncate = needs_truncation(params)
    assert truncate == (case == "truncating")
    fn = jax.jit(sample, static_argnames=("use_processors", "truncate"))
    logits = _logits(R)
    for step in range(4):
        md = build_sampling_metadata([_row(p, seed=i, step=step) for i, p in enumerate(params)], R, HIST)
        want = fn(logits, md, use_processors=False, truncate=None)
        got = fn(logits, md, use_processors=False, truncate=truncate)
        np.testing.assert_array_equal(np.asarray(got.token_ids), np.asarray(want.token_ids))
        np.testing.assert_array_equal(np.asarray(got.logprob), np.asarray(want.logprob))
