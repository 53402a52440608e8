"""Turns a scheduler step into fixed-shape numpy inputs padded to a bucket.

Layout of one step (T = token bucket, R = row bucket = min(T, max_num_seqs), M = max blocks/seq):
sequences in scheduler order (decode rows first, then prefill chunks), their new tokens laid out
back to back from row 0, padding afterwards. Padding tokens write to the null block 0 and padded
sequence slots have kv_len 0, so the attention ignores them. A step of one-token rows takes its
block tables from the runner's persistent batch (jaxengine/persistent_batch.py) when it is given.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator

import jax
import numpy as np

from jaxengine.models.attention import AttentionMetadata
from jaxengine.packing import Layout
from jaxengine.persistent_batch import BatchRows, PersistentBatch
from jaxengine.scheduler import PLACEHOLDER, ScheduledSeq


_token_ids = operator.attrgetter("token_ids")
_first = operator.itemgetter(0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attn: AttentionMetadata
    logits_indices: jax.Array  # [R] int32 last new token of each sequence (0 for padding rows)
    prev_index: jax.Array  # [T] int32 row of the previous step's samples that is this token, or -1
    lora_slot: jax.Array  # [T] int32 device slot of the token's LoRA adapter (0: none)


class InputBuilder:
    """Preallocated host buffers per bucket, refilled each step (no per-step allocation of big arrays).

    One set per bucket: the runner sends a packed copy (jaxengine.packing), so the device never
    reads these buffers and the next step may refill them while this one runs.
    """

    def __init__(self, max_blocks_per_seq: int, block_size: int):
        self.m = max_blocks_per_seq
        self.block_size = block_size
        self._buffers: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self._flat: dict[tuple[int, int], np.ndarray] = {}  # the packed buffer each bucket's buffers view
        # (bucket, slots array, the batch's `rows` call) of the last build, if it was from the
        # persistent batch with every token in flight on the rows of the step before (the steady
        # decode state): the next such build of the same slots rewrites only what changed.
        self._last_steady: tuple[tuple[int, int], np.ndarray, int] | None = None

    def _bufs(self, t: int, r: int) -> dict[str, np.ndarray]:
        key = (t, r)
        if key not in self._buffers:
            bufs = {
                "input_ids": np.zeros(t, np.int32), "positions": np.zeros(t, np.int32),
                "slot_mapping": np.zeros(t, np.int32), "kv_lens": np.zeros(r, np.int32),
                "block_tables": np.zeros((r, self.m), np.int32),
                "query_start_loc": np.zeros(r + 1, np.int32), "num_seqs": np.zeros(1, np.int32),
                "logits_indices": np.zeros(r, np.int32), "prev_index": np.full(t, -1, np.int32),
                "lora_slot": np.zeros(t, np.int32),
            }
            # Each buffer becomes a view into one flat buffer laid out as `pack` lays out the
            # step's inputs, so `packed` is one copy instead of a pack per step.
            layout = Layout.of(self._inputs(bufs))
            at = {id(leaf): off for leaf, off in zip(jax.tree.leaves(self._inputs(bufs)), layout.offsets)}
            flat = np.zeros(layout.size, np.int32)
            for name, a in bufs.items():
                view = flat[at[id(a)]:at[id(a)] + a.size].reshape(a.shape)
                view[...] = a
                bufs[name] = view
            self._flat[key] = flat
            self._buffers[key] = bufs
        return self._buffers[key]

    def packed(self, t: int, r: int) -> np.ndarray:
        """`pack` of the inputs that `build` last returned for bucket (t, r): a copy of that
        bucket's flat buffer (the device gets a copy, so the next build may refill it)."""
        return self._flat[(t, r)].copy()

    def build(self, seqs: list[ScheduledSeq], t: int, r: int, prev_rows: dict[str, int] | None = None,
              lora_slots: list[int] | None = None, batch: tuple[PersistentBatch, BatchRows] | None = None,
              same_rows: bool = False) -> StepInputs:
        """`seqs`: one step's rows in scheduler order (decode rows first).

        A decode row whose token is still a placeholder (sampled by the step in flight) gets
        `prev_index` = that step's row for the request (`prev_rows`), and the device fills it in.
        `lora_slots`: each row's LoRA device slot (None: no adapters this step). `batch`: the
        runner's persistent batch and this step's rows in it, given only for a step of one-token
        rows: block tables are gathered from its slots instead of read from every row. `same_rows`
        (with `batch` only): the step in flight had these rows in this order, each sampling, so a
        row's token in flight is the same row of its samples and `prev_rows` is not read.
        """
        assert len(seqs) <= r, (len(seqs), r)
        b = self._bufs(t, r)
        bs, n_seqs = self.block_size, len(seqs)
        last, self._last_steady = self._last_steady, None
        if batch is not None and lora_slots is None and same_rows and batch[1].in_flight:
            rows = batch[1]
            self._last_steady = ((t, r), rows.slots, rows.call)
            if (rows.grown is not None and last is not None and last[0] == (t, r) and last[1] is rows.slots
                    and last[2] == rows.call - 1):  # the build before: these rows, one position back
                return self._build_steady(b, batch[0], rows)
        b["lora_slot"].fill(0)
        if batch is not None:  # one token per row (the runner checked)
            if lora_slots is not None:
                b["lora_slot"][:n_seqs] = lora_slots
            return self._build_from_batch(seqs, b, prev_rows, *batch, same_rows)
        lens = [s.num_new_tokens for s in seqs]
        if lora_slots is not None:
            b["lora_slot"][:sum(lens)] = np.repeat(np.asarray(lora_slots, np.int32), lens)
        if sum(lens) == n_seqs and n_seqs:
            return self._build_single_token_rows(seqs, b, prev_rows)
        # One pass of plain list work (C-speed extends), then a few vectorised numpy writes:
        # host time per step matters at hundreds of sequences.
        ids: list[int] = []
        slots: list[int] = []
        table_flat: list[int] = []
        table_lens: list[int] = []
        prev_at: list[int] = []
        prev_rows_of: list[int] = []
        starts: list[int] = []
        for s in seqs:
            start, n, blocks = s.start, s.num_new_tokens, s.block_ids
            starts.append(start)
            toks = s.token_ids
            if n == 1:
                tok = toks[0]
                if tok == PLACEHOLDER:  # sampled by the step in flight: only ever a decode row's token
                    assert prev_rows is not None, s.request_id
                    prev_at.append(len(ids))
                    prev_rows_of.append(prev_rows[s.request_id])
                    tok = 0
                ids.append(tok)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                assert toks[-1] != PLACEHOLDER, (s.request_id, n)
                ids.extend(toks)
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            table_flat.extend(blocks)
            table_lens.append(len(blocks))
        total = len(ids)
        assert total <= t, (total, t)
        for name in ("input_ids", "positions", "slot_mapping"):
            b[name][total:] = 0
        b["input_ids"][:total] = ids
        b["slot_mapping"][:total] = slots
        starts_a = np.asarray(starts, np.int32)
        qsl = b["query_start_loc"]
        qsl[0] = 0
        b["kv_lens"].fill(0)
        b["logits_indices"].fill(0)
        lens_a = np.asarray(lens, np.int32)
        np.cumsum(lens_a, out=qsl[1:n_seqs + 1])
        offsets = np.repeat(qsl[:n_seqs], lens_a)  # first row of each token's sequence
        b["positions"][:total] = np.repeat(starts_a, lens_a) + np.arange(total) - offsets
        b["kv_lens"][:n_seqs] = starts_a + lens_a
        qsl[n_seqs + 1:] = total
        b["logits_indices"][:n_seqs] = qsl[1:n_seqs + 1] - 1
        tables = b["block_tables"]
        tables.fill(0)
        if table_flat:
            tl = np.asarray(table_lens)
            if tl.min() == tl.max():  # equal lengths (common in a decode batch): one slice write
                tables[:n_seqs, :tl[0]] = np.asarray(table_flat, np.int32).reshape(n_seqs, tl[0])
            else:
                rows = np.repeat(np.arange(n_seqs), tl)
                cols = np.arange(len(table_flat)) - np.repeat(np.cumsum(tl) - tl, tl)
                tables[rows, cols] = table_flat
        b["prev_index"].fill(-1)
        if prev_at:
            b["prev_index"][prev_at] = prev_rows_of
        b["num_seqs"][0] = n_seqs
        return self._inputs(b)

    def _build_single_token_rows(self, seqs: list[ScheduledSeq], b: dict[str, np.ndarray],
                                 prev_rows: dict[str, int] | None) -> StepInputs:
        """`build` when every row has one new token (a decode batch, the steady state): a column
        per comprehension and numpy for the rest, instead of a Python loop over the rows."""
        bs, n = self.block_size, len(seqs)
        starts = [s.start for s in seqs]
        tables = [s.block_ids for s in seqs]
        starts_a = np.asarray(starts, np.int32)
        self._single_token_rows(seqs, b, prev_rows, starts_a)
        blocks = np.asarray([tbl[p // bs] for tbl, p in zip(tables, starts)], np.int32)
        b["slot_mapping"][:n] = blocks * bs + starts_a % bs
        tl = np.asarray([len(tbl) for tbl in tables])
        flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(tl.sum()))
        bt = b["block_tables"]
        bt.fill(0)
        if tl.min() == tl.max():
            bt[:n, :tl[0]] = flat.reshape(n, tl[0])
        else:
            bt[np.repeat(np.arange(n), tl), np.arange(len(flat)) - np.repeat(np.cumsum(tl) - tl, tl)] = flat
        b["num_seqs"][0] = n
        return self._inputs(b)

    def _build_from_batch(self, seqs: list[ScheduledSeq], b: dict[str, np.ndarray], prev_rows: dict[str, int] | None,
                          batch: PersistentBatch, rows: BatchRows, same_rows: bool = False) -> StepInputs:
        """`_build_single_token_rows` with block tables gathered from the persistent batch: the
        same arrays, reading only each row's first token besides what `rows` holds."""
        bs, n = self.block_size, len(seqs)
        starts_a = rows.starts
        toks = np.full(n, PLACEHOLDER, np.int32) if rows.in_flight else None
        self._single_token_rows(seqs, b, prev_rows, starts_a, same_rows, toks)
        bt = b["block_tables"]
        bt[:n] = batch.block_tables[rows.slots]
        bt[n:] = 0
        b["slot_mapping"][:n] = bt[np.arange(n), starts_a // bs] * bs + starts_a % bs
        b["num_seqs"][0] = n
        return self._inputs(b)

    def _build_steady(self, b: dict[str, np.ndarray], batch: PersistentBatch, rows: BatchRows) -> StepInputs:
        """`_build_from_batch` when this bucket's buffers hold the step before of the same rows
        (same slots array, every token in flight, no LoRA): only what moves with the position
        and the tables that grew are rewritten; token ids, prev_index, query starts, logits rows
        and the padding are already what they would be written to."""
        bs, n, starts_a = self.block_size, len(rows.slots), rows.starts
        b["positions"][:n] = starts_a
        b["kv_lens"][:n] = starts_a + 1
        bt = b["block_tables"]
        if rows.grown:
            bt[rows.grown] = batch.block_tables[rows.slots[rows.grown]]
        b["slot_mapping"][:n] = bt[_arange(n), starts_a // bs] * bs + starts_a % bs
        return self._inputs(b)

    @staticmethod
    def _single_token_rows(seqs: list[ScheduledSeq], b: dict[str, np.ndarray], prev_rows: dict[str, int] | None,
                           starts_a: np.ndarray, same_rows: bool = False, toks: np.ndarray | None = None) -> None:
        """What both one-token-per-row builders fill alike: token ids (a token still in flight as
        its row of the previous step's samples), positions, KV lengths, query starts and logits
        rows; the slots past the rows zeroed (slot_mapping's included). `toks`: the rows' tokens
        when the caller has them ([n] int32, overwritten), else read from `seqs`."""
        n = len(seqs)
        if toks is None:
            toks = np.fromiter(map(_first, map(_token_ids, seqs)), np.int32, n)
        pending = np.flatnonzero(toks == PLACEHOLDER)  # sampled by the step in flight
        b["prev_index"].fill(-1)
        if len(pending):
            if same_rows:  # the step in flight had these rows in this order
                b["prev_index"][pending] = pending
            elif len(pending) == n:
                assert prev_rows is not None, seqs[0].request_id
                b["prev_index"][:n] = [prev_rows[s.request_id] for s in seqs]
            else:
                assert prev_rows is not None, seqs[int(pending[0])].request_id
                b["prev_index"][pending] = [prev_rows[seqs[i].request_id] for i in pending.tolist()]
            toks[pending] = 0
        for name in ("input_ids", "positions", "slot_mapping"):
            b[name][n:] = 0
        b["input_ids"][:n] = toks
        b["positions"][:n] = starts_a
        b["kv_lens"].fill(0)
        b["kv_lens"][:n] = starts_a + 1
        qsl = b["query_start_loc"]
        qsl[:n + 1] = np.arange(n + 1, dtype=np.int32)
        qsl[n + 1:] = n
        b["logits_indices"].fill(0)
        b["logits_indices"][:n] = qsl[1:n + 1] - 1

    @staticmethod
    def _inputs(b: dict[str, np.ndarray]) -> StepInputs:
        attn = AttentionMetadata(b["slot_mapping"], b["kv_lens"], b["block_tables"], b["query_start_loc"],
                                 b["num_seqs"])
        return StepInputs(b["input_ids"], b["positions"], attn, b["logits_indices"], b["prev_index"], b["lora_slot"])


@functools.lru_cache(maxsize=16)
def _arange(n: int) -> np.ndarray:
    a = np.arange(n)
    a.flags.writeable = False
    return a


def prompt_logprob_targets(seqs: list[ScheduledSeq], t: int) -> np.ndarray | None:
    """[T] int32: the next prompt token of every row whose request asked for prompt logprobs
    (-1 elsewhere and in padding); None when no row of this step wants them."""
    if not any(s.spec.params.prompt_logprobs is not None and s.start < len(s.spec.prompt_token_ids) for s in seqs):
        return None
    targets = np.full(t, -1, np.int32)
    cursor = 0
    for s in seqs:
        n = s.num_new_tokens
        prompt = s.spec.prompt_token_ids
        if s.spec.params.prompt_logprobs is not None:
            pos = np.arange(s.start, s.start + n)
            ok = pos + 1 < len(prompt)
            targets[cursor:cursor + n][ok] = np.asarray(prompt)[pos[ok] + 1]
        cursor += n
    return targets


def abstract_inputs(t: int, r: int, m: int) -> StepInputs:
    i32 = np.int32
    s = jax.ShapeDtypeStruct
    attn = AttentionMetadata(s((t,), i32), s((r,), i32), s((r, m), i32), s((r + 1,), i32), s((1,), i32))
    return StepInputs(s((t,), i32), s((t,), i32), attn, s((r,), i32), s((t,), i32), s((t,), i32))
