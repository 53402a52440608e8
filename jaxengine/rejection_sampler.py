"""Speculative decoding's verification step on the device: which drafts are accepted, which
tokens each row outputs.

A proposer (n-gram lookup or a draft model) guesses up to K next tokens for a request row;
the target model's forward runs the row's last accepted token and its drafts in one pass, so
the step has logits at K+1 positions (`[R, K+1, V]`): position j is the distribution of the
token after the row's j-th input token. `verify` turns them into between 1 and num_drafts + 1
output tokens per row, with the distribution of decoding one token at a time:

- greedy rows (temperature 0) accept drafts while each equals the argmax at its position, then
  output that argmax at the first mismatch (or at position num_drafts when all matched): the
  tokens greedy decoding gives without speculation;
- random rows use speculative rejection sampling (Leviathan et al., 2023; vLLM's
  RejectionSampler): draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)), p the
  distribution `sample` draws from (temperature, top-k / top-p, min-p, bans) and q the
  proposer's (a point mass for n-gram drafts); at the first rejection the token is drawn from
  max(0, p_j - q_j) renormalised, and when every draft is accepted a bonus token is drawn from
  p at position num_drafts. Each output token then follows p exactly.

Randomness depends only on the row's (seed, output index) and a tag: the acceptance uniform
of position j from (seeds[r], steps[r] + j, tag), the draw at position j from the Gumbel
noise `sample` uses at step steps[r] + j. So a seeded request is reproducible in any batch,
and a row with no drafts (num_drafts = 0) samples exactly the token `sample` would: rows that
speculate and rows that do not share one program.

Shapes are fixed and there is no `lax.cond` or loop: every position's argmax, acceptance test
and draw is computed with vectorised ops, and the first rejection comes from a cumulative
product of the acceptance mask (a cond would make XLA's GPU runtime wait on the host; see
`sampler.sample`). Only `truncate` sorts the vocabulary; logprobs are of the raw logits, as the
sampler reports them, one row normaliser subtracted from the few values returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxengine.sampler import SamplingMetadata, _gumbel, _mask_banned, _truncate_sorted, top_k_two_stage
from jaxengine.sampling_params import MAX_LOGPROBS

# fold_in tag of the acceptance uniforms, so they are independent of the Gumbel noise of the
# same (seed, output index), which is keyed without a tag.
_ACCEPT_TAG = 1


@jax.tree_util.register_dataclass
@dataclass
class VerifyOutput:
    """One verification step's result for the host. R rows, P = K + 1 positions, L top logprobs.

    Entries past `num_tokens` are padding: token id -1, logprob 0, rank 0 (top ids and top
    logprobs are those of the position all the same)."""

    token_ids: jax.Array  # [R, P] int32 the row's output tokens this step (accepted drafts, then one), -1 padded
    num_tokens: jax.Array  # [R] int32 how many token_ids are real: accepted drafts + 1, in 1..num_drafts + 1
    logprob: jax.Array  # [R, P] f32 raw log-softmax of each output token at its position
    rank: jax.Array  # [R, P] int32 its 1-based rank among the position's raw logits
    top_ids: jax.Array  # [R, P, L] int32 each position's most likely token ids by raw logits
    top_logprobs: jax.Array  # [R, P, L] f32 their raw logprobs, descending


def _uniforms(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """[N] uniforms in [0, 1); entry i depends only on (seeds[i], steps[i])."""

    def one(seed: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), _ACCEPT_TAG)
        return jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(seeds, steps)


def _per_position(x: jax.Array, positions: int) -> jax.Array:
    """Row array [R, ...] repeated for each position: [R * P, ...], row-major (r, j)."""
    return jnp.repeat(x, positions, axis=0)


def verify(logits: jax.Array, draft_ids: jax.Array, num_drafts: jax.Array, md: SamplingMetadata, *,
           draft_probs: jax.Array | None = None, truncate: bool,
           num_top_logprobs: int = MAX_LOGPROBS) -> VerifyOutput:
    """Accepts or rejects each row's drafts and picks its output tokens; jit with `truncate` and
    `num_top_logprobs` static (point-mass and draft-model calls are separate programs).

    logits: [R, P, V] target logits, P = K + 1 (any float dtype; computed in f32).
    draft_ids: [R, K] int32 proposed tokens, -1 past a row's drafts.
    num_drafts: [R] int32 in 0..K; 0 samples one token from position 0, as `sample` does.
    md: the rows' plain-variant metadata; steps[r] is the output index of position 0's token.
        banned_ids apply at every position (a row whose min_tokens ends inside the step keeps
        them a few tokens longer: never too early); the processor fields are not read.
    draft_probs: None for point-mass drafts (q(d) = 1), else [R, K, V] f32 the proposer's
        probabilities at each draft position.
    truncate: whether any row applies top-k / top-p (`sampler.needs_truncation`).
    """
    r, p, vocab = logits.shape
    k = p - 1
    assert draft_ids.shape == (r, k), (draft_ids.shape, logits.shape)
    assert num_drafts.shape == (r,), num_drafts.shape
    assert draft_probs is None or draft_probs.shape == (r, k, vocab), draft_probs.shape
    n = r * p
    raw = logits.astype(jnp.float32).reshape(n, vocab)  # rows (r, j), row-major
    log_norm = jax.nn.logsumexp(raw, axis=-1)  # [N]
    processed = _mask_banned(raw, _per_position(md.banned_ids, p))  # [N, V]

    greedy_tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)  # [N]
    row_max = jnp.take_along_axis(processed, greedy_tokens[:, None], axis=-1)[:, 0]  # [N]

    # The target distribution p of random rows, as `sampler._random_tokens` builds it (same ops,
    # so a row without drafts draws the same token): temperature, top-k / top-p, min-p.
    greedy_row = md.temperature <= 0.0  # [R]
    temperature = _per_position(jnp.where(greedy_row, 1.0, md.temperature), p)  # [N]
    scaled = processed / temperature[:, None]
    if truncate:
        scaled = _truncate_sorted(scaled, _per_position(md.top_k, p), _per_position(md.top_p, p))
    floor = row_max / temperature + _per_position(jnp.log(md.min_p), p)  # [N]
    target = jnp.where(scaled >= floor[:, None], scaled, -jnp.inf)  # [N, V] log p up to a constant
    target_norm = jax.nn.logsumexp(target, axis=-1)  # [N]

    pos = jnp.arange(p, dtype=jnp.int32)  # [P]
    has_draft = pos[None, :] < num_drafts[:, None]  # [R, P]: position j checks draft j
    drafts = jnp.concatenate([draft_ids, jnp.full((r, 1), -1, jnp.int32)], axis=1)  # [R, P]
    drafts = jnp.where(has_draft, drafts, -1).reshape(n)  # -1 where nothing is checked
    safe_drafts = jnp.maximum(drafts, 0)[:, None]  # [N, 1]

    # Acceptance: draft j (j < num_drafts) is kept with probability min(1, p(d) / q(d)), i.e. when
    # u * q(d) < p(d) for u uniform in [0, 1).
    p_draft = jnp.exp(jnp.take_along_axis(target, safe_drafts, axis=-1)[:, 0] - target_norm)  # [N]
    steps = (md.steps[:, None] + pos[None, :]).reshape(n)  # [N] output index of each position
    seeds = _per_position(md.seeds, p)  # [N]
    u = _uniforms(seeds, steps)
    if draft_probs is None:
        q_draft = jnp.ones((n,), jnp.float32)
    else:
        q = jnp.concatenate([draft_probs.astype(jnp.float32), jnp.zeros((r, 1, vocab), jnp.float32)], axis=1)
        q = q.reshape(n, vocab)
        q_draft = jnp.take_along_axis(q, safe_drafts, axis=-1)[:, 0]
    random_accept = u * q_draft < p_draft
    greedy_accept = drafts == greedy_tokens
    accept = jnp.where(_per_position(greedy_row, p), greedy_accept, random_accept) & (drafts >= 0)  # [N]
    accept = accept.reshape(r, p)
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [R] leading run, <= num_drafts

    # One draw per position, meaningful only at the first rejection (from the residual) or at
    # num_drafts (the bonus, from p itself); which one is decided by position, not by outcome,
    # so the draw's noise is independent of the acceptance test.
    cols = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    if draft_probs is None:  # residual of a point mass: p without the draft, renormalised
        residual = jnp.where(cols == drafts[:, None], -jnp.inf, target)
        empty = jnp.all(residual == -jnp.inf, axis=-1)
    else:
        mass = jnp.maximum(jnp.exp(target - target_norm[:, None]) - q, 0.0)  # [N, V]
        residual = jnp.log(mass)
        empty = jnp.all(mass <= 0.0, axis=-1)
    # A rejection with an empty residual has probability 0 (p(d) = q(d) everywhere); it comes
    # only from rounding, and then p is as good a draw as any.
    use_residual = (drafts >= 0) & ~empty
    draw_logits = jnp.where(use_residual[:, None], residual, target)
    noise = _gumbel(seeds, steps, vocab)  # [N, V], the noise `sample` uses at these steps
    random_tokens = jnp.argmax(draw_logits + noise, axis=-1).astype(jnp.int32)  # [N]
    tokens = jnp.where(_per_position(greedy_row, p), greedy_tokens, random_tokens).reshape(r, p)

    # Output: accepted drafts, then the draw at the first rejection (or the bonus), then -1.
    final = jnp.take_along_axis(tokens, num_accepted[:, None], axis=1)  # [R, 1]
    out_ids = jnp.where(pos[None, :] < num_accepted[:, None], drafts.reshape(r, p),
                        jnp.where(pos[None, :] == num_accepted[:, None], final, -1))  # [R, P]

    real = (out_ids >= 0).reshape(n)
    token_logit = jnp.take_along_axis(raw, jnp.maximum(out_ids, 0).reshape(n, 1), axis=-1)  # [N, 1]
    rank = jnp.where(real, 1 + jnp.sum(raw > token_logit, axis=-1, dtype=jnp.int32), 0)
    logprob = jnp.where(real, token_logit[:, 0] - log_norm, 0.0)
    top_values, top_ids = top_k_two_stage(raw, num_top_logprobs)  # [N, L]
    return VerifyOutput(token_ids=out_ids.astype(jnp.int32), num_tokens=(num_accepted + 1).astype(jnp.int32),
                        logprob=logprob.reshape(r, p), rank=rank.reshape(r, p),
                        top_ids=top_ids.astype(jnp.int32).reshape(r, p, num_top_logprobs),
                        top_logprobs=(top_values - log_norm[:, None]).reshape(r, p, num_top_logprobs))
