"""Speculative verification (`verify`) against numpy references, on CPU with small vocabularies.

Distribution tests give every row of one big batch the same logits and drafts but its own
seed, so each row is an independent draw; chi-square tests at p = 0.001 compare the output
tokens' frequencies with the target distribution.
"""

import re

import jax
import numpy as np
import pytest

from jaxengine.rejection_sampler import VerifyOutput, verify
from jaxengine.sampler import SamplingRow, build_sampling_metadata, sample
from jaxengine.sampling_params import MAX_LOGPROBS, SamplingParams

V = 32
K = 3
P = K + 1
R = 8  # small batches
N = 6000  # draws: rows of one big batch

_verify = jax.jit(verify, static_argnames=("truncate", "num_top_logprobs"))
_sample = jax.jit(sample, static_argnames=("use_processors", "truncate"))


def _md(params, seeds, steps, num_rows, eos=()):
    rows = [SamplingRow(p, int(s), int(t), [1, 2], [], tuple(eos)) for p, s, t in zip(params, seeds, steps)]
    return build_sampling_metadata(rows, num_rows, 1, processors=False)


def _logits(shape, seed=0, scale=2.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def _check_padding(out: VerifyOutput, num_drafts):
    ids, n = np.asarray(out.token_ids), np.asarray(out.num_tokens)
    num_drafts = np.asarray(num_drafts)
    assert ids.shape[1] == P and ids.dtype == np.int32 and n.dtype == np.int32
    assert ((n >= 1) & (n <= num_drafts + 1)).all()
    real = np.arange(P)[None, :] < n[:, None]
    assert (ids[~real] == -1).all() and (ids[real] >= 0).all() and (ids[real] < V).all()
    assert (np.asarray(out.rank)[~real] == 0).all() and (np.asarray(out.logprob)[~real] == 0).all()


def _check_raw_logprobs(out: VerifyOutput, logits):
    ref = _log_softmax(logits)  # [R, P, V]
    ids = np.asarray(out.token_ids)
    real = ids >= 0
    safe = np.maximum(ids, 0)
    tok_lp = np.take_along_axis(ref, safe[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprob)[real], tok_lp[real], rtol=1e-5, atol=1e-5)
    rank = 1 + (ref > tok_lp[..., None]).sum(-1)
    np.testing.assert_array_equal(np.asarray(out.rank)[real], rank[real])
    order = np.argsort(-ref, axis=-1, kind="stable")[..., :MAX_LOGPROBS]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, order, -1), rtol=1e-5, atol=1e-5)


def _chi2_critical(df: int, z: float = 3.0902) -> float:
    """Chi-square quantile at p = 0.001 (z = its normal quantile), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def _check_distribution(tokens, expected):
    """Chi-square goodness of fit; bins expecting fewer than 10 draws are pooled."""
    tokens = np.asarray(tokens)
    assert np.isin(tokens, np.flatnonzero(expected > 0)).all(), "a token outside the support"
    counts = np.bincount(tokens, minlength=expected.shape[0]).astype(np.float64)
    want = expected * tokens.shape[0]
    small = want < 10
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(want[~small], want[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    assert chi2 < _chi2_critical(obs.size - 1), (chi2, obs.size - 1)


def _truncated(logits, t, top_k=0, top_p=1.0, min_p=0.0):
    """numpy reference of the sampler's target distribution for one position."""
    probs = _softmax(logits.astype(np.float64) / t)
    order = np.argsort(-probs)
    if top_k:
        cut = np.zeros_like(probs)
        cut[order[:top_k]] = probs[order[:top_k]]
        probs = cut / cut.sum()
    if top_p < 1.0:
        before = np.cumsum(probs[order]) - probs[order]
        cut = np.zeros_like(probs)
        keep = order[before < top_p]
        cut[keep] = probs[keep]
        probs = cut / cut.sum()
    probs = np.where(probs >= min_p * probs.max(), probs, 0)
    return probs / probs.sum()


# -- greedy ----------------------------------------------------------------------------------
def _greedy_reference(logits, drafts, num_drafts, banned):
    out = []
    for r in range(logits.shape[0]):
        x = logits[r].copy()
        x[:, [b for b in banned[r] if b >= 0]] = -np.inf
        toks = []
        for j in range(num_drafts[r] + 1):
            best = int(np.argmax(x[j]))
            if j < num_drafts[r] and drafts[r, j] == best:
                toks.append(best)
            else:
                toks.append(best)
                break
        out.append(toks)
    return out


def test_greedy_matches_reference_and_sample():
    logits = _logits((R, P, V), seed=1)
    logits[7, 0, 30], logits[7, 1, 30] = -10.0, 10.0  # row 7: 30 is the argmax of position 1 only
    chain = logits.argmax(-1)  # [R, P]
    drafts = chain[:, :K].copy()
    drafts[1, 1] = (chain[1, 1] + 1) % V  # second draft wrong
    drafts[2, 0] = (chain[2, 0] + 3) % V  # first draft wrong
    drafts[3, 2] = (chain[3, 2] + 5) % V  # last draft wrong
    num_drafts = np.array([3, 3, 3, 3, 0, 2, 1, 3], np.int32)
    drafts[np.arange(K)[None, :] >= num_drafts[:, None]] = -1
    # Row 7 bans the argmax of position 1 (min_tokens): its draft there is then rejected.
    eos = int(chain[7, 1])
    params = [SamplingParams(temperature=0)] * 7 + [SamplingParams(temperature=0, min_tokens=5)]
    md = _md(params, range(R), [0] * R, R, eos=[eos])
    out = _verify(logits, drafts, num_drafts, md, truncate=False)
    _check_padding(out, num_drafts)
    ref = _greedy_reference(logits, drafts, num_drafts, md.banned_ids)
    for r in range(R):
        n = int(out.num_tokens[r])
        assert np.asarray(out.token_ids[r, :n]).tolist() == ref[r], r
    np.testing.assert_array_equal(out.num_tokens, [4, 2, 1, 3, 1, 3, 2, 2])
    assert int(out.token_ids[7, 1]) != eos
    plain = _sample(logits[:, 0], md, use_processors=False, truncate=False)
    np.testing.assert_array_equal(out.token_ids[4, 0], plain.token_ids[4])
    _check_raw_logprobs(out, logits)


# -- no drafts: exactly today's sampler ------------------------------------------------------
@pytest.mark.parametrize("truncate", [False, True])
def test_rows_without_drafts_sample_what_sample_samples(truncate):
    logits = _logits((R, P, V), seed=2, scale=1.0)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, min_p=0.05, seed=2), SamplingParams(temperature=1.0, seed=3)]
    if truncate:
        params += [SamplingParams(temperature=0.9, top_p=0.8, seed=4), SamplingParams(temperature=1.1, top_k=5)]
    params += [SamplingParams(temperature=1.0)] * (R - len(params))
    num_drafts = np.array([0, 0, 0, 3, 0, 2, 0, 1], np.int32)  # speculating rows mixed in
    drafts = np.where(np.arange(K)[None, :] < num_drafts[:, None], logits[:, :K].argmax(-1), -1).astype(np.int32)
    for step in (0, 5, 11):
        md = _md(params, [7 + i for i in range(R)], [step + i for i in range(R)], R)
        out = _verify(logits, drafts, num_drafts, md, truncate=truncate)
        want = _sample(logits[:, 0], md, use_processors=False, truncate=truncate)
        plain = num_drafts == 0
        np.testing.assert_array_equal(np.asarray(out.token_ids)[plain, 0], np.asarray(want.token_ids)[plain])
        np.testing.assert_array_equal(np.asarray(out.num_tokens)[plain], 1)
        _check_padding(out, num_drafts)


# -- distributions ---------------------------------------------------------------------------
def _batch(logits_pv, drafts, num_drafts, params, draft_probs=None):
    """N independent rows (seeds 0..N-1) with the same logits [P, V]; `drafts` [K] (every row
    the same) or [N, K]."""
    logits = np.broadcast_to(logits_pv, (N, P, V))
    drafts = np.broadcast_to(np.asarray(drafts, np.int32), (N, K))
    num_drafts = np.full((N,), num_drafts, np.int32)
    md = _md([params] * N, range(N), [0] * N, N)
    out = _verify(logits, drafts, num_drafts, md, draft_probs=draft_probs, truncate=params.truncates)
    _check_padding(out, num_drafts)
    return np.asarray(out.token_ids), np.asarray(out.num_tokens)


@pytest.mark.parametrize("truncate", [False, True])
def test_point_mass_drafts_keep_the_target_distribution(truncate):
    logits = _logits((P, V), seed=3, scale=1.0)
    logits[0, 4] = logits[0].max() + 2.0  # a likely token at position 0
    params = (SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02) if truncate
              else SamplingParams(temperature=0.8))
    targets = [_truncated(logits[j], 0.8, params.top_k, params.top_p, params.min_p) for j in range(P)]
    p0 = targets[0]
    unlikely = int(np.flatnonzero(p0 > 0)[np.argmin(p0[p0 > 0])])
    outside = int(np.argmin(p0)) if (p0 == 0).any() else unlikely
    first_accepted, second = [], []
    for d0 in (4, unlikely, outside):  # likely, unlikely, and (when truncating) impossible drafts
        ids, n = _batch(logits, [d0, 7, 9], 3, params)
        _check_distribution(ids[:, 0], p0)
        accepted = n >= 2
        np.testing.assert_array_equal(accepted, ids[:, 0] == d0)  # a point mass is never redrawn
        second.append(ids[accepted, 1])
        first_accepted.append(accepted.mean())
    assert first_accepted[0] > 0.5 and first_accepted[1] < 0.1  # about p0(d0)
    np.testing.assert_allclose(first_accepted[0], p0[4], atol=0.03)
    _check_distribution(np.concatenate(second), targets[1])  # the next token, given the draft was kept


def test_draft_model_probs_keep_the_target_distribution():
    logits = _logits((P, V), seed=4, scale=1.0)
    q_logits = logits[:K] + _logits((K, V), seed=5, scale=1.0)  # a related but different proposer
    q = _softmax(q_logits.astype(np.float64))
    params = SamplingParams(temperature=1.0)
    rng = np.random.default_rng(6)
    drafts = np.stack([rng.choice(V, size=N, p=q[j]) for j in range(K)], axis=1).astype(np.int32)  # d ~ q
    q32 = np.broadcast_to(q.astype(np.float32), (N, K, V))
    ids, n = _batch(logits, drafts, K, params, draft_probs=q32)
    targets = [_softmax(logits[j].astype(np.float64)) for j in range(P)]
    _check_distribution(ids[:, 0], targets[0])
    accepted = n >= 2
    assert 0.3 < accepted.mean() < 0.95  # q differs from p: some drafts are rejected
    _check_distribution(ids[accepted, 1], targets[1])
    np.testing.assert_array_equal(ids[accepted, 0], drafts[accepted, 0])


def test_peaked_drafts_are_accepted():
    logits = _logits((P, V), seed=7, scale=1.0)
    chain = logits.argmax(-1)
    logits[np.arange(P), chain] += 20.0
    ids, n = _batch(logits, chain[:K], K, SamplingParams(temperature=1.0))
    assert (n == P).mean() > 0.999
    np.testing.assert_array_equal(ids[n == P], np.broadcast_to(chain, ((n == P).sum(), P)))


def test_same_seed_and_step_same_tokens_in_any_batch():
    logits = _logits((R, P, V), seed=8, scale=0.3)
    drafts = logits[:, :K].argmax(-1).astype(np.int32)
    num_drafts = np.full((R,), K, np.int32)
    params = [SamplingParams(temperature=1.0)] * R
    a = _verify(logits, drafts, num_drafts, _md(params, range(R), [4] * R, R), truncate=False)
    perm = np.roll(np.arange(R), 3)
    b = _verify(logits[perm], drafts[perm], num_drafts, _md(params, perm, [4] * R, R), truncate=False)
    np.testing.assert_array_equal(np.asarray(b.token_ids), np.asarray(a.token_ids)[perm])
    _check_raw_logprobs(a, logits)


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("with_probs", [False, True])
def test_program_holds_no_cond_or_loop(truncate, with_probs):
    """No lax.cond / while_loop: they make XLA's GPU runtime wait on the host."""
    md = _md([SamplingParams(temperature=1.0)] * R, range(R), [0] * R, R)
    probs = np.full((R, K, V), 1.0 / V, np.float32) if with_probs else None
    jaxpr = str(jax.make_jaxpr(lambda *a: verify(*a, draft_probs=probs, truncate=truncate))(
        _logits((R, P, V)), np.zeros((R, K), np.int32), np.full((R,), K, np.int32), md))
    primitives = set(re.findall(r"= (\w+)\[", jaxpr))
    assert "sort" in primitives if truncate else "sort" not in primitives  # the sort only when truncating
    assert not primitives & {"cond", "while"}, primitives
