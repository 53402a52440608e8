"""On-device sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

The engine calls `sample` inside a jitted step on the last-position logits of every request
row (`[R, V]`, R = the request bucket). Per-row parameters arrive as `SamplingMetadata`, a
registered pytree of fixed-shape arrays built on the host by `build_sampling_metadata`; padding
rows are greedy with neutral parameters, so they cost nothing special and change nothing.

Order of operations (as vLLM): logprobs are taken from the raw logits; then, only in the
`use_processors` variant, repetition / frequency / presence penalties, `logit_bias`,
`allowed_token_ids` (every other token masked) and `bad_words` (a word's last token banned when
the output ends with the tokens before it); the tokens that may not end the output yet
(min_tokens) are banned; greedy rows take the argmax; random rows divide by
the temperature, keep the top-k, then the top-p nucleus, then drop tokens below min_p times the
most likely one, and draw with the Gumbel-max trick from a key that depends only on the row's
(seed, step), so a seeded request samples the same tokens whatever batch it lands in.

Only top-p / top-k sort the vocabulary; no full-vocabulary sort or log-softmax is materialised
on the common path: top logprobs come from a two-stage top-k.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.packing import Layout, pack
from jaxengine.sampling_params import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                                       MAX_LOGPROBS, SamplingParams, lean_form)
from jaxengine.persistent_batch import BatchRows, PersistentBatch
from jaxengine.scheduler import PLACEHOLDER, ScheduledSeq

logger = logging.getLogger(__name__)

# Width of `SamplingMetadata.banned_ids`: token ids a row may not sample this step (eos and
# stop ids while fewer than min_tokens are out). Longer lists are cut, with a warning.
MAX_BANNED_IDS = 8


@jax.tree_util.register_dataclass
@dataclass
class SamplingMetadata:
    """Per-row sampling state for one step. R = request-bucket rows, L = history length.

    The history and the logit edits are read only by the `use_processors` variant; the plain
    variant is compiled with width 1 for each (`build_sampling_metadata(..., processors=False)`).
    """

    temperature: jax.Array  # [R] f32, 0 = greedy
    top_p: jax.Array  # [R] f32, 1 = off
    top_k: jax.Array  # [R] int32, 0 = off
    min_p: jax.Array  # [R] f32, 0 = off
    presence_penalty: jax.Array  # [R] f32
    frequency_penalty: jax.Array  # [R] f32
    repetition_penalty: jax.Array  # [R] f32, 1 = off
    seeds: jax.Array  # [R] uint32 per-row seed
    steps: jax.Array  # [R] int32 output index of the token being sampled
    history: jax.Array  # [R, L] int32 prompt then output tokens, -1 padded (rows that read it: penalties, bad words)
    num_prompt: jax.Array  # [R] int32 how many leading history entries are prompt tokens
    banned_ids: jax.Array  # [R, MAX_BANNED_IDS] int32 ids that may not be sampled now, -1 padded
    bias_ids: jax.Array  # [R, E] int32 logit_bias token ids, -1 padded
    bias_values: jax.Array  # [R, E] f32 their biases
    allowed_ids: jax.Array  # [R, A] int32 allowed_token_ids, -1 padded; all -1 = no restriction
    bad_prefix: jax.Array  # [R, W, MAX_BAD_WORD_TOKENS - 1] int32 tokens before a bad word's last, right-aligned, -1 padded
    bad_last: jax.Array  # [R, W] int32 a bad word's last token, -1 = none
    bitmask: jax.Array  # [R, ceil(V / 32)] int32 structured outputs' allowed tokens (bit t % 32 of word t // 32); width 1 unread


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    """What one step's sampling hands back to the host (one device-to-host transfer)."""

    token_ids: jax.Array  # [R] int32 sampled token
    logprob: jax.Array  # [R] f32 raw log-softmax of the sampled token
    top_ids: jax.Array  # [R, K] int32 most likely token ids by raw logits, K = num_top_logprobs
    top_logprobs: jax.Array  # [R, K] f32 their raw logprobs, descending
    rank: jax.Array  # [R] int32 1-based rank of the sampled token among raw logits


class SamplingRow(NamedTuple):
    """One request row's host-side sampling state, input to `build_sampling_metadata`."""

    params: SamplingParams
    seed: int  # the request's seed (its own, or one the engine drew for it)
    step: int  # number of output tokens so far = index of the token being sampled
    prompt_ids: Sequence[int]  # read only when the row reads its history; numpy arrays copy fastest
    output_ids: Sequence[int]
    eos_token_ids: Sequence[int] = ()  # banned with stop_token_ids until min_tokens are out


def needs_truncation(params_list: Sequence[SamplingParams]) -> bool:
    """Whether any row samples with top-k or top-p (the sampler's sort)."""
    return any(p.truncates for p in params_list)


def needs_processors(params_list: Sequence[SamplingParams]) -> bool:
    """Whether any row needs the `use_processors` variant: penalties (which read the token
    history) or logit edits (logit_bias, allowed_token_ids, bad_words)."""
    return any(p.uses_penalties or p.uses_logit_edits for p in params_list)


# -- host side: building the metadata --------------------------------------------------------
def _banned_for(row: SamplingRow) -> list[int]:
    p = row.params
    if row.step >= p.min_tokens:
        return []
    eos = () if p.ignore_eos else row.eos_token_ids
    return list(dict.fromkeys([*eos, *p.stop_token_ids]))


# Column order of SamplingParams.sampler_row, and the values of a padding row.
_NEUTRAL_ROW = (0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0)


def _fill_history(history: np.ndarray, num_prompt: np.ndarray, rows: Sequence[SamplingRow]) -> None:
    """Writes prompt + output ids of the rows whose sampling reads them (penalties, bad words
    of several tokens); a row longer than `L` keeps its newest `L` tokens (output tokens matter
    most: frequency / presence and bad words read only them)."""
    length = history.shape[1]
    for i, r in enumerate(rows):
        if not r.params.reads_history:
            continue
        n_p, n_o = len(r.prompt_ids), len(r.output_ids)
        if n_p + n_o <= length:
            history[i, :n_p] = r.prompt_ids
            history[i, n_p : n_p + n_o] = r.output_ids
            num_prompt[i] = n_p
        elif n_o >= length:
            history[i] = r.output_ids[n_o - length :]
            num_prompt[i] = 0
        else:
            keep = length - n_o
            history[i, :keep] = r.prompt_ids[n_p - keep :]
            history[i, keep:] = r.output_ids
            num_prompt[i] = keep


def build_sampling_metadata(rows: Sequence[SamplingRow], num_rows: int, history_len: int,
                            processors: bool | None = None, mask_words: int = 1) -> SamplingMetadata:
    """Fixed-shape numpy metadata for `rows`, padded to `num_rows` with neutral greedy rows.

    `processors`: the layout of the `use_processors` variant (the logit edits at full width);
    None: whether any row needs it. The history (prompt + output ids per row) is filled only for
    rows whose sampling reads it: the plain variant never reads it, so callers compiling that
    variant may pass `history_len=1`. Histories longer than `history_len` keep their most recent
    tokens. `mask_words`: the width of the structured-output bitmask (every token allowed; the
    engine writes constrained rows' masks in), 1 in the variants that do not read it.
    """
    return _metadata([r.params for r in rows], [r.seed for r in rows], [r.step for r in rows],
                     rows.__getitem__, num_rows, history_len, processors, mask_words)


def in_flight_history_id(prev_row: int) -> int:
    """The history entry of an output token that the step in flight is still sampling: the
    device reads it from that step's tokens, at the request's row `prev_row` (`resolve_history`),
    so a request whose sampling reads its history need not wait for the step before."""
    return -2 - prev_row


def batch_sampling_metadata(seqs: Sequence[ScheduledSeq], eos_token_ids: Sequence[int], num_rows: int,
                            processors_history_len: int, mask_words: int = 1,
                            prev_rows: dict[str, int] | None = None) -> tuple[SamplingMetadata, bool, bool]:
    """`build_sampling_metadata` for one step's rows straight from the scheduler's output, and
    whether any row needs the `use_processors` variant (then the history is
    `processors_history_len` long, else 1). `prev_rows`: each request's row in the step in
    flight, for output tokens that are still placeholders (see `in_flight_history_id`).

    This runs every step for every running request, so the per-row Python work is a few
    attribute reads; a `SamplingRow` is made only for the rare rows that need one (penalties,
    logit edits, banned ids before min_tokens).
    """
    specs = [s.spec for s in seqs]
    params = [sp.params for sp in specs]
    steps = [s.start + s.num_new_tokens - s.num_drafts - len(sp.prompt_token_ids) for s, sp in zip(seqs, specs)]

    def row(i: int) -> SamplingRow:
        sp = specs[i]
        outs = seqs[i].output_token_ids or ()
        if outs and outs[-1] == PLACEHOLDER:  # sampled by the step in flight
            if prev_rows is None or seqs[i].request_id not in prev_rows:
                raise RuntimeError(f"request {seqs[i].request_id}: an unsampled output token and no step in flight")
            outs = [*outs[:-1], in_flight_history_id(prev_rows[seqs[i].request_id])]
        return SamplingRow(sp.params, sp.seed, steps[i], sp.prompt_token_ids, outs, eos_token_ids)

    processors = needs_processors(params)
    return (_metadata(params, [sp.seed for sp in specs], steps, row, num_rows,
                      processors_history_len if processors else 1, processors, mask_words), processors,
            needs_truncation(params))


def _column_rows(batch: PersistentBatch, rows: BatchRows, num_rows: int) -> tuple[np.ndarray, int, np.ndarray] | None:
    """(slots, row count, each row's output step) of a step of one-token rows, or None when a row
    needs more than the persistent batch's columns hold (logits processors, or ids banned before
    min_tokens)."""
    slots, n = rows.slots, len(rows.slots)
    if n > num_rows:
        raise ValueError(f"{n} sampling rows do not fit in a bucket of {num_rows}")
    steps = rows.starts + 1 - batch.prompt_len[slots]
    if batch.needs_processors[slots].any() or (steps < batch.min_tokens[slots]).any():
        return None
    return slots, n, steps


def rows_sampling_metadata(batch: PersistentBatch, rows: BatchRows, num_rows: int,
                           mask_words: int = 1) -> tuple[SamplingMetadata, bool] | None:
    """`batch_sampling_metadata` of a step of one-token rows (each samples the token after its
    `start`) from the persistent batch's columns, and whether any row truncates; None when a row
    needs more than the columns hold (logits processors, or ids banned before min_tokens): the
    caller builds it from the rows then. Equal arrays to `batch_sampling_metadata`'s."""
    found = _column_rows(batch, rows, num_rows)
    if found is None:
        return None
    slots, n, steps = found
    values = np.empty((num_rows, len(_NEUTRAL_ROW)), np.float32)
    values[n:] = _NEUTRAL_ROW
    values[:n] = batch.sampler_values[slots]
    seeds_a = np.zeros((num_rows,), np.uint32)
    seeds_a[:n] = batch.seeds[slots]
    steps_a = np.zeros((num_rows,), np.int32)
    steps_a[:n] = steps
    columns = values.T
    md = SamplingMetadata(
        temperature=columns[0].copy(), top_p=columns[1].copy(), top_k=columns[2].astype(np.int32),
        min_p=columns[3].copy(), presence_penalty=columns[4].copy(), frequency_penalty=columns[5].copy(),
        repetition_penalty=columns[6].copy(), seeds=seeds_a, steps=steps_a, **_unused_columns(num_rows, mask_words))
    return md, bool(batch.truncates[slots].any())


def rows_sampling_packed(batch: PersistentBatch, rows: BatchRows, num_rows: int) -> tuple[np.ndarray, bool] | None:
    """`pack` of `rows_sampling_metadata`'s metadata (mask width 1) and whether any row
    truncates, written straight into a copy of the packed neutral metadata; None where
    `rows_sampling_metadata` is None."""
    slots, n = rows.slots, len(rows.slots)
    cached = batch.packed_sampling
    if cached is None or cached.slots is not slots or cached.num_rows != num_rows:
        # The same slots array means the same requests in the same slots (the batch makes a new
        # one whenever a row changes): only the steps differ from the step that built this.
        cached = batch.packed_sampling = _PackedRows.of(batch, slots, num_rows)
    if cached.buf is None or (cached.min_tokens_below is not None and (rows.starts < cached.min_tokens_below).any()):
        return None
    buf = cached.buf.copy()
    buf[cached.steps_at:cached.steps_at + n] = rows.starts + cached.step_of_start
    return buf, cached.truncate


@dataclass(frozen=True, slots=True)
class _PackedRows:
    """`rows_sampling_packed`'s work that depends on the slots only (n = rows, R = num_rows)."""

    slots: np.ndarray  # [n] the slots it was built for (compared by identity)
    num_rows: int  # R
    buf: np.ndarray | None  # packed metadata with every column but the steps written; None: a row needs processors
    steps_at: int  # where the steps start in `buf`
    step_of_start: np.ndarray  # [n] int32 a row's output step is its start plus this (1 - prompt length)
    min_tokens_below: np.ndarray | None  # [n] int32 a row bans ids while its start is below this; None: no row does
    truncate: bool  # some row truncates (top-k / top-p)

    @staticmethod
    def of(batch: PersistentBatch, slots: np.ndarray, num_rows: int) -> _PackedRows:
        n = len(slots)
        if n > num_rows:
            raise ValueError(f"{n} sampling rows do not fit in a bucket of {num_rows}")
        template, value_at, seeds_at, steps_at = _packed_template(num_rows)
        step_of_start = (1 - batch.prompt_len[slots]).astype(np.int32)
        min_tokens = batch.min_tokens[slots]
        below = (min_tokens - step_of_start) if (min_tokens > 0).any() else None
        buf = None
        if not batch.needs_processors[slots].any():
            buf = template.copy()
            as_f32 = buf.view(np.float32)
            values = batch.sampler_values[slots]  # [n, 7] in SamplingMetadata's field order
            for k, at in enumerate(value_at):
                if k == 2:  # top_k is an int32 column
                    buf[at:at + n] = values[:, k].astype(np.int32)
                else:
                    as_f32[at:at + n] = values[:, k]
            buf.view(np.uint32)[seeds_at:seeds_at + n] = batch.seeds[slots]
            buf.flags.writeable = False
        return _PackedRows(slots, num_rows, buf, steps_at, step_of_start, below, bool(batch.truncates[slots].any()))


@functools.lru_cache(maxsize=64)
def _packed_template(num_rows: int) -> tuple[np.ndarray, tuple[int, ...], int, int]:
    """The packed metadata of `num_rows` neutral rows (read only), and where the sampler
    values' seven columns, the seeds and the steps start in it."""
    values = np.tile(np.asarray(_NEUTRAL_ROW, np.float32), (num_rows, 1)).T
    md = SamplingMetadata(
        temperature=values[0].copy(), top_p=values[1].copy(), top_k=values[2].astype(np.int32),
        min_p=values[3].copy(), presence_penalty=values[4].copy(), frequency_penalty=values[5].copy(),
        repetition_penalty=values[6].copy(), seeds=np.zeros((num_rows,), np.uint32),
        steps=np.zeros((num_rows,), np.int32), **_unused_columns(num_rows, 1))
    at = dict(zip(map(id, jax.tree.leaves(md)), Layout.of(md).offsets))
    value_at = tuple(at[id(getattr(md, name))] for name in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"))
    template = pack(md)
    template.flags.writeable = False
    return template, value_at, at[id(md.seeds)], at[id(md.steps)]


@functools.lru_cache(maxsize=64)
def _unused_columns(num_rows: int, mask_words: int) -> dict[str, np.ndarray]:
    """The columns that a step without logits processors or bitmask leaves at their neutral
    values, built once per shape and shared by every such step (read only)."""
    cols = dict(history=np.full((num_rows, 1), -1, np.int32), num_prompt=np.zeros((num_rows,), np.int32),
                banned_ids=np.full((num_rows, MAX_BANNED_IDS), -1, np.int32),
                bias_ids=np.full((num_rows, 1), -1, np.int32), bias_values=np.zeros((num_rows, 1), np.float32),
                allowed_ids=np.full((num_rows, 1), -1, np.int32), bad_prefix=np.full((num_rows, 1, 1), -1, np.int32),
                bad_last=np.full((num_rows, 1), -1, np.int32), bitmask=np.full((num_rows, mask_words), -1, np.int32))
    for a in cols.values():
        a.flags.writeable = False
    return cols


def _fill_logit_edits(md: dict[str, np.ndarray], rows: Sequence[SamplingRow]) -> None:
    """Writes each row's logit_bias, allowed_token_ids and bad words into the edit columns."""
    lb = md["bad_prefix"].shape[2]
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            ids = list(p.logit_bias)
            md["bias_ids"][i, : len(ids)] = ids
            md["bias_values"][i, : len(ids)] = [p.logit_bias[t] for t in ids]
        if p.allowed_token_ids:
            md["allowed_ids"][i, : len(p.allowed_token_ids)] = p.allowed_token_ids
        for j, word in enumerate(p.bad_words_token_ids):
            md["bad_last"][i, j] = word[-1]
            if len(word) > 1:
                md["bad_prefix"][i, j, lb - len(word) + 1:] = word[:-1]


def _metadata(params: list[SamplingParams], seeds: Sequence[int], steps: list[int],
              row: Callable[[int], SamplingRow], num_rows: int, history_len: int,
              processors: bool | None = None, mask_words: int = 1) -> SamplingMetadata:
    """The metadata from per-row columns; `row(i)` gives row i's full state where needed.

    The parameter columns come from bytes cached on each frozen SamplingParams.
    """
    n = len(params)
    if n > num_rows:
        raise ValueError(f"{n} sampling rows do not fit in a bucket of {num_rows}")
    if history_len < 1:
        raise ValueError(f"history_len must be at least 1, got {history_len}")
    if processors is None:
        processors = needs_processors(params)
    width = len(_NEUTRAL_ROW)
    values = np.empty((num_rows, width), np.float32)
    values[n:] = _NEUTRAL_ROW
    seeds_a = np.zeros((num_rows,), np.uint32)
    steps_a = np.zeros((num_rows,), np.int32)
    num_prompt = np.zeros((num_rows,), np.int32)
    history = np.full((num_rows, history_len), -1, np.int32)
    banned = np.full((num_rows, MAX_BANNED_IDS), -1, np.int32)
    e, a, w = (MAX_LOGIT_BIAS, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS) if processors else (1, 1, 1)
    edits = {"bias_ids": np.full((num_rows, e), -1, np.int32), "bias_values": np.zeros((num_rows, e), np.float32),
             "allowed_ids": np.full((num_rows, a), -1, np.int32),
             "bad_prefix": np.full((num_rows, w, MAX_BAD_WORD_TOKENS - 1 if processors else 1), -1, np.int32),
             "bad_last": np.full((num_rows, w), -1, np.int32)}
    if n:
        values[:n] = np.frombuffer(b"".join([p.sampler_row_f32 for p in params]), np.float32).reshape(n, width)
        seeds_a[:n] = [s & 0xFFFFFFFF for s in seeds]
        steps_a[:n] = steps
        if processors:
            edited = [i for i, p in enumerate(params) if p.reads_history or p.uses_logit_edits]
            if edited:
                full = [row(i) for i in range(n)]
                _fill_history(history, num_prompt, full)
                _fill_logit_edits(edits, full)
        min_tokens = [p.min_tokens for p in params]
        if any(min_tokens):
            for i in np.flatnonzero(steps_a[:n] < np.asarray(min_tokens)):
                ids = _banned_for(row(int(i)))
                if len(ids) > MAX_BANNED_IDS:
                    logger.warning("request bans %d stop ids during min_tokens; only the first %d are enforced",
                                   len(ids), MAX_BANNED_IDS)
                    ids = ids[:MAX_BANNED_IDS]
                banned[i, : len(ids)] = ids
    columns = values.T  # [7, R]; each row below is a contiguous copy
    return SamplingMetadata(
        temperature=columns[0].copy(), top_p=columns[1].copy(), top_k=columns[2].astype(np.int32),
        min_p=columns[3].copy(), presence_penalty=columns[4].copy(), frequency_penalty=columns[5].copy(),
        repetition_penalty=columns[6].copy(), seeds=seeds_a, steps=steps_a,
        history=history, num_prompt=num_prompt, banned_ids=banned, **edits,
        bitmask=np.full((num_rows, mask_words), -1, np.int32))


# -- device side -----------------------------------------------------------------------------
def resolve_history(history: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """history [R, L] with the entries `in_flight_history_id` wrote replaced by the tokens the
    step before sampled (prev_tokens [P], still on the device)."""
    from_prev = prev_tokens[jnp.clip(-2 - history, 0, prev_tokens.shape[0] - 1)]
    return jnp.where(history <= -2, from_prev, history)


def _scatter_rows(ids: jax.Array, values: jax.Array, vocab: int) -> jax.Array:
    """[R, V] sums of `values` [R, L] at token ids `ids` [R, L]; ids < 0 are dropped."""
    r = ids.shape[0]
    safe = jnp.where(ids < 0, vocab, ids)  # out of bounds -> dropped by mode="drop"
    rows = jnp.broadcast_to(jnp.arange(r)[:, None], ids.shape)
    return jnp.zeros((r, vocab), values.dtype).at[rows, safe].add(values, mode="drop")


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Repetition (prompt + output), then frequency and presence (output only), as vLLM.

    logits: [R, V] f32. Repetition divides positive logits by the penalty and multiplies
    negative ones, so a penalty > 1 always makes a seen token less likely.
    """
    vocab = logits.shape[-1]
    hist = md.history  # [R, L]
    pos = jnp.arange(hist.shape[1])[None, :]
    valid = hist >= 0
    is_output = valid & (pos >= md.num_prompt[:, None])
    output_counts = _scatter_rows(hist, is_output.astype(jnp.float32), vocab)  # [R, V]
    seen = _scatter_rows(hist, valid.astype(jnp.float32), vocab) > 0  # [R, V]
    rep = md.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts
    logits = logits - md.presence_penalty[:, None] * (output_counts > 0)
    return logits


def apply_logit_edits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """logit_bias added, tokens outside allowed_token_ids and matched bad words set to -inf.

    A bad word of several tokens matches when the row's output (the history after its prompt)
    ends with the tokens before the word's last; a one-token bad word always matches.
    """
    r, vocab = logits.shape
    logits = logits + _scatter_rows(md.bias_ids, md.bias_values, vocab)
    restricted = md.allowed_ids[:, 0] >= 0  # [R]
    allowed = _scatter_rows(md.allowed_ids, jnp.ones(md.allowed_ids.shape, jnp.float32), vocab) > 0
    logits = jnp.where(restricted[:, None] & ~allowed, -jnp.inf, logits)
    hist = md.history  # [R, L]
    lp = md.bad_prefix.shape[2]
    n_valid = jnp.sum(hist >= 0, axis=-1)  # [R]: prompt + output tokens held
    idx = n_valid[:, None] - lp + jnp.arange(lp)[None, :]  # [R, lp]: the last lp positions
    tail = jnp.take_along_axis(hist, jnp.clip(idx, 0, hist.shape[1] - 1), axis=-1)
    tail_is_output = (idx >= md.num_prompt[:, None]) & (idx >= 0)
    ok = (md.bad_prefix < 0) | ((md.bad_prefix == tail[:, None, :]) & tail_is_output[:, None, :])
    hit = jnp.all(ok, axis=-1) & (md.bad_last >= 0)  # [R, W]
    banned = _scatter_rows(jnp.where(hit, md.bad_last, -1), jnp.ones(hit.shape, jnp.float32), vocab) > 0
    return jnp.where(banned, -jnp.inf, logits)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """`logits` [R, V] with tokens the structured-output bitmask [R, ceil(V / 32)] does not
    allow set to -inf (bit t % 32 of word t // 32 allows token t). Elementwise: it fuses into
    the consumers."""
    r, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1  # [R, W, 32]
    allowed = bits.reshape(r, -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def _sort_key(x: jax.Array) -> jax.Array:
    """int32 keys ordered like the float32 values `x` (total order, -inf lowest).

    XLA sorts plain int32 keys with CUB radix sort on GPU, about twice as fast as its
    comparator sort of floats."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def _from_sort_key(k: jax.Array) -> jax.Array:
    """Inverse of `_sort_key`."""
    i = jnp.where(k < 0, k ^ jnp.int32(0x7FFFFFFF), k)
    return jax.lax.bitcast_convert_type(i, jnp.float32)


def _truncate_sorted(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.

    Sorts each row once and derives a per-row threshold, so nothing is scattered back;
    tokens tied with the threshold are all kept.
    """
    vocab = scaled.shape[-1]
    keys = _sort_key(scaled)  # [R, V]
    desc_keys = ~jax.lax.sort(~keys, dimension=1)  # [R, V] descending (~ reverses int order)
    desc = _from_sort_key(desc_keys)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # [R]
    ranks = jnp.arange(vocab)[None, :]
    in_k = ranks < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)  # renormalised over the top k
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [R, V] exclusive cumulative mass
    # Keep the smallest prefix whose mass reaches top_p: token i stays while the mass before it
    # is still short of top_p. The first token always stays.
    keep = (mass_before < top_p[:, None]) & in_k
    num_keep = jnp.where(top_p < 1.0, jnp.maximum(keep.sum(-1), 1), k)  # [R]
    threshold = jnp.take_along_axis(desc_keys, (num_keep - 1)[:, None], axis=-1)  # [R, 1]
    return jnp.where(keys >= threshold, scaled, -jnp.inf)


def top_k_two_stage(x: jax.Array, k: int, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """The k largest entries per row of `x` [R, V]: (values [R, k] descending, ids [R, k]).

    XLA lowers `lax.top_k` with k > 16 to a full sort of [R, V] (milliseconds at 256 x 128k
    on an H100), so go in two stages: the k blocks of `block` entries with the largest maxima
    hold the k largest values (a block outside them has k blocks above it, so k larger
    values), then top-k among those k * block candidates. Same values as `lax.top_k`; among
    equal values the ids may differ.
    """
    r, vocab = x.shape
    num_blocks = -(-vocab // block)
    if num_blocks < 2 * k:  # small vocabularies: one stage is cheap
        return jax.lax.top_k(x, k)
    pad = num_blocks * block - vocab
    padded = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x
    blocks = padded.reshape(r, num_blocks, block)
    _, best_blocks = jax.lax.top_k(blocks.max(axis=-1), k)  # [R, k]
    candidates = jnp.take_along_axis(blocks, best_blocks[:, :, None], axis=1).reshape(r, k * block)
    values, j = jax.lax.top_k(candidates, k)  # [R, k]
    ids = (best_blocks[:, :, None] * block + jnp.arange(block)[None, None, :]).reshape(r, k * block)
    return values, jnp.minimum(jnp.take_along_axis(ids, j, axis=-1), vocab - 1)


def _gumbel(seeds: jax.Array, steps: jax.Array, vocab: int) -> jax.Array:
    """[R, V] Gumbel noise; row r depends only on (seeds[r], steps[r])."""

    def one(seed: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    return jax.vmap(one)(seeds, steps)


def _mask_banned(logits: jax.Array, banned_ids: jax.Array) -> jax.Array:
    """`logits` [R, V] with each row's `banned_ids` [R, B] (-1 = none) set to -inf.

    B compares per element, fused into the consumers: cheaper than a scatter, which would
    copy the whole [R, V] array."""
    cols = jnp.arange(logits.shape[-1], dtype=jnp.int32)[None, :]
    hit = cols == banned_ids[:, :1]
    for j in range(1, banned_ids.shape[1]):
        hit = hit | (cols == banned_ids[:, j : j + 1])
    return jnp.where(hit, -jnp.inf, logits)


def _random_tokens(logits: jax.Array, row_max: jax.Array, md: SamplingMetadata, truncate: bool | None) -> jax.Array:
    """[R] tokens drawn from the temperature-scaled, truncated distribution of each row.

    logits: [R, V] after penalties and bans; row_max: [R] their row maxima. `truncate`: whether
    to apply top-k / top-p (a sort of [R, V], the costliest part of sampling on GPU); None:
    decided on the device, only when a row asks for it.
    """
    greedy = md.temperature <= 0.0
    temperature = jnp.where(greedy, 1.0, md.temperature)  # [R]
    scaled = logits / temperature[:, None]
    if truncate is None:
        needs_sort = jnp.any(~greedy & ((md.top_k > 0) | (md.top_p < 1.0)))
        scaled = jax.lax.cond(needs_sort, _truncate_sorted, lambda s, k, p: s, scaled, md.top_k, md.top_p)
    elif truncate:
        scaled = _truncate_sorted(scaled, md.top_k, md.top_p)
    # min-p: p_i >= min_p * p_max  <=>  x_i >= max(x) + log(min_p), no softmax needed. The most
    # likely token survives top-k / top-p, so max(x) is row_max / temperature.
    floor = row_max / temperature + jnp.log(md.min_p)  # [R]; -inf where min_p = 0
    noise = _gumbel(md.seeds, md.steps, logits.shape[-1])
    return jnp.argmax(jnp.where(scaled >= floor[:, None], scaled, -jnp.inf) + noise, axis=-1).astype(jnp.int32)


# The sampler's lean forms (`sample`'s `lean`), for steps where no row asks for logprobs.
LEAN_MODES = ("sample", "greedy")


def lean_mode(params_list: Sequence[SamplingParams]) -> str | None:
    """The lean form of the sampler for these rows: "greedy" when every row is greedy and none
    asks for logprobs, "sample" when no row asks for logprobs, else None (the full sampler)."""
    return lean_form(any(p.logprobs is not None for p in params_list), all(p.is_greedy for p in params_list))


def sample(logits: jax.Array, md: SamplingMetadata, *, use_processors: bool, use_bitmask: bool = False,
           truncate: bool | None = None, num_top_logprobs: int = MAX_LOGPROBS,
           lean: str | None = None) -> SamplerOutput:
    """Samples one token per row of `logits` [R, V] under `md`; jit with `use_processors`
    (penalties and logit edits: see `needs_processors`), `use_bitmask` (structured outputs'
    allowed tokens, applied after them) and `truncate` static.

    `truncate`: whether any row applies top-k / top-p (`needs_truncation`), known on the host.
    With True or False the program holds no `lax.cond`: XLA's GPU runtime reads a conditional's
    predicate on the host, so a cond makes the host wait, inside the program's launch, for all
    the work queued before it (the step's forward), and the device idles while the host then
    prepares the next step. None keeps the device-side decisions (all rows greedy; any row
    truncating) as conds: the `use_processors` variant, whose requests are rare and slower anyway.

    Logprobs, top logprobs and ranks describe the raw model distribution (before penalties,
    bans and temperature), as vLLM reports them. The full [R, V] log-softmax is never built:
    the row log-normaliser is subtracted from the few values reported.

    `lean` (static, `lean_mode`; only without processors and bitmask): no row asks for logprobs,
    so none are computed: the logprob and rank come back as zeros and the top logprobs [R, 0].
    "greedy": every row is greedy, so the tokens are the rows' argmax and no draw is made. The
    tokens are those of the full sampler either way.
    """
    if lean is not None and (lean not in LEAN_MODES or use_processors or use_bitmask):
        raise ValueError(f"sample: lean={lean!r} takes neither processors nor a bitmask (forms {LEAN_MODES})")
    logits = logits.astype(jnp.float32)
    processed = apply_logit_edits(apply_penalties(logits, md), md) if use_processors else logits
    if use_bitmask:
        processed = apply_bitmask(processed, md.bitmask)
    processed = _mask_banned(processed, md.banned_ids)

    greedy_tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)  # [R]
    if lean == "greedy":
        return _lean_output(greedy_tokens)
    row_max = jnp.take_along_axis(processed, greedy_tokens[:, None], axis=-1)[:, 0]  # [R]
    if truncate is None:
        tokens = jax.lax.cond(
            jnp.all(md.temperature <= 0.0),
            lambda: greedy_tokens,
            lambda: jnp.where(md.temperature <= 0.0, greedy_tokens, _random_tokens(processed, row_max, md, None)),
        )
    else:  # the draw is computed for greedy rows too (its noise is cheap next to a host wait)
        tokens = jnp.where(md.temperature <= 0.0, greedy_tokens, _random_tokens(processed, row_max, md, truncate))
    if lean is not None:
        return _lean_output(tokens)

    log_norm = jax.nn.logsumexp(logits, axis=-1)  # [R]
    token_logit = jnp.take_along_axis(logits, tokens[:, None], axis=-1)  # [R, 1] raw
    rank = 1 + jnp.sum(logits > token_logit, axis=-1, dtype=jnp.int32)
    top_values, top_ids = top_k_two_stage(logits, num_top_logprobs)
    return SamplerOutput(token_ids=tokens, logprob=token_logit[:, 0] - log_norm,
                         top_ids=top_ids.astype(jnp.int32), top_logprobs=top_values - log_norm[:, None],
                         rank=rank)


def _lean_output(tokens: jax.Array) -> SamplerOutput:
    """A lean sampler's output: the tokens, zeros for the logprob and rank, no top logprobs."""
    r = tokens.shape[0]
    return SamplerOutput(token_ids=tokens, logprob=jnp.zeros((r,), jnp.float32), top_ids=jnp.zeros((r, 0), jnp.int32),
                         top_logprobs=jnp.zeros((r, 0), jnp.float32), rank=jnp.zeros((r,), jnp.int32))
