"""Row-stable host state of the running requests, so a decode step reads few Python objects.

Each request the runner sees gets a slot that it keeps while it runs (vLLM v1's InputBatch):
numpy columns per slot hold what does not change from step to step, its block table (rewritten
only when the table grows or is a new list), its sampling parameters as the sampler's columns,
its seed and prompt length. A step then reads four attributes per row (id, start, first token,
block table) and gathers the rest by slot with numpy, instead of rebuilding every column from the
scheduler's objects.

A slot's contents are keyed by its request's block-table list (`ScheduledSeq.block_ids`, the
block manager's own list for the request): the list grows in place while the request runs (a
new block; a sliding window zeroes entries only when it grows), and a request that is preempted
and readmitted, or a new request under an old id, has a new list. A row whose list is not the
one its slot holds is filled again, so a missed release can never serve stale state; releases
(`release`, from the scheduler's finished and preempted ids) only keep slots free.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from jaxengine.sampling_params import lean_form
from jaxengine.scheduler import ScheduledSeq
from jaxengine.steady_decode import DecodeColumns

_SAMPLER_WIDTH = 7  # columns of SamplingParams.sampler_row_f32
_request_id = operator.attrgetter("request_id")
_block_ids = operator.attrgetter("block_ids")
_start = operator.attrgetter("start")


@dataclasses.dataclass(slots=True)
class BatchRows:
    """One step's rows as persistent slots (n = rows of the step, in scheduler order)."""

    slots: np.ndarray  # [n] int64 slot of each row
    starts: np.ndarray  # [n] int32 position of each row's first new token
    ids: list[str]  # [n] each row's request id
    in_flight: bool = False  # every row's token is a placeholder (the step in flight samples it)
    # Rows whose block table changed since the batch's last `rows` call (number `call` - 1), when
    # these are the rows of that call (the scheduler's same columns); None: unknown.
    grown: list[int] | None = None
    call: int = 0  # the batch's count of `rows` calls, this one included


class PersistentBatch:
    """Per-request columns at stable slots; `rows` maps a step's rows to their slots."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int):
        cap = 2 * max_rows  # room for finished requests whose release has not arrived yet
        self.capacity = cap
        self._slot_of: dict[str, int] = {}
        self._free = list(range(cap - 1, -1, -1))
        # Slot `cap` is a sentinel: it holds no table, so an unknown id never matches.
        self._table_of: list[list[int] | None] = [None] * (cap + 1)
        self.block_tables = np.zeros((cap, max_blocks_per_seq), np.int32)  # zero past each table
        self.table_len = np.zeros(cap, np.int64)
        self.sampler_values = np.zeros((cap, _SAMPLER_WIDTH), np.float32)
        self.seeds = np.zeros(cap, np.uint32)
        self.prompt_len = np.zeros(cap, np.int32)
        self.min_tokens = np.zeros(cap, np.int32)
        self.needs_processors = np.zeros(cap, bool)  # penalties or logit edits: the full metadata path
        self.truncates = np.zeros(cap, bool)
        self.prompt_logprobs = np.zeros(cap, bool)  # asked for prompt logprobs
        self.logprobs = np.zeros(cap, bool)  # asked for logprobs of its sampled tokens
        self.greedy = np.zeros(cap, bool)
        # The last `rows` call's (ids, tables, slots, slots array), while no slot was released
        # since: a step with the same rows and table lists has the same slots (the steady state).
        self._last: tuple[list[str], list[list[int]], list[int], np.ndarray] | None = None
        # jaxengine.sampler's packed sampling metadata of the last slots array it was asked for
        # (all but the steps: the same slots array means the same requests in the same slots).
        self.packed_sampling = None
        self._calls = 0  # `rows` calls so far
        self._prompt_logprobs_of: tuple[np.ndarray, bool] | None = None  # `wants_prompt_logprobs`' last answer
        self._lean_of: tuple[np.ndarray, str | None] | None = None  # `lean_mode`'s last answer

    def release(self, request_ids: list[str]) -> None:
        """Frees the slots of requests that stopped running (finished, aborted, preempted)."""
        for rid in request_ids:
            slot = self._slot_of.pop(rid, None)
            if slot is not None:
                self._table_of[slot] = None
                self._free.append(slot)
                self._last = None

    def rows(self, seqs: list[ScheduledSeq], columns: DecodeColumns | None = None) -> BatchRows:
        """The slots of `seqs`, filling the rows that are new and the block tables that grew.
        `columns`: the same rows as the scheduler's columns (a steady decode step), read instead
        of the rows, so a step with the rows of the step before costs no Python per row."""
        n = len(seqs)
        self._calls += 1
        if columns is not None:
            ids, tables = columns.ids, columns.tables
        else:
            ids = list(map(_request_id, seqs))
            tables = list(map(_block_ids, seqs))
        last = self._last
        if last is not None and ids is last[0] and tables is last[1]:  # the scheduler's same columns
            slots, slots_a = last[2], last[3]
            for i in columns.grown:  # the only tables that changed since the step before
                self._write_table(slots[i], tables[i])
            return BatchRows(slots_a, columns.starts, ids, columns.in_flight, columns.grown, self._calls)
        if last is not None and ids == last[0] and all(map(operator.is_, tables, last[1])):
            slots, slots_a = last[2], last[3]  # each slot still holds its row's table
            self._last = (ids, tables, slots, slots_a)  # (the scheduler's lists, if it gave them)
        else:
            sentinel = self.capacity
            slots = [self._slot_of.get(rid, sentinel) for rid in ids]
            table_of = self._table_of
            if not all(map(operator.is_, [table_of[j] for j in slots], tables)):
                slots = self._assign(seqs, ids, tables, slots)
            slots_a = np.asarray(slots, np.int64)
            slots_a.flags.writeable = False  # shared with the next step's rows while they are the same
            self._last = (ids, tables, slots, slots_a)
        lens = np.fromiter(map(len, tables), np.int64, n)
        for i in np.flatnonzero(lens != self.table_len[slots_a]).tolist():
            self._write_table(slots[i], tables[i])
        if columns is not None:
            return BatchRows(slots_a, columns.starts, ids, columns.in_flight, call=self._calls)
        return BatchRows(slots_a, np.fromiter(map(_start, seqs), np.int32, n), ids, call=self._calls)

    def wants_prompt_logprobs(self, slots: np.ndarray) -> bool:
        """Whether a request at one of `slots` asked for prompt logprobs (kept for the last slots
        array asked about: the same array means the same requests)."""
        last = self._prompt_logprobs_of
        if last is None or last[0] is not slots:
            last = self._prompt_logprobs_of = (slots, bool(self.prompt_logprobs[slots].any()))
        return last[1]

    def lean_mode(self, slots: np.ndarray) -> str | None:
        """The sampler's lean form (sampling_params.lean_form) for the requests at `slots` (kept for
        the last slots array asked about, as `wants_prompt_logprobs`)."""
        last = self._lean_of
        if last is None or last[0] is not slots:
            last = self._lean_of = (slots, lean_form(bool(self.logprobs[slots].any()), bool(self.greedy[slots].all())))
        return last[1]

    def _assign(self, seqs: list[ScheduledSeq], ids: list[str], tables: list[list[int]],
                slots: list[int]) -> list[int]:
        """Gives the rows whose slot does not hold their table a slot, filled from the row."""
        table_of = self._table_of
        stale = [i for i, (j, tbl) in enumerate(zip(slots, tables)) if table_of[j] is not tbl]
        if len(stale) > len(self._free) + sum(slots[i] != self.capacity for i in stale):
            self.reset()  # releases were missed: start over (every row of this step fits)
            slots = [self.capacity] * len(seqs)
            stale = list(range(len(seqs)))
        for i in stale:
            rid = ids[i]
            slot = self._slot_of.get(rid)
            if slot is None:
                slot = self._free.pop()
                self._slot_of[rid] = slot
            slots[i] = slot
            self._fill(slot, seqs[i])
        return slots

    def _fill(self, slot: int, seq: ScheduledSeq) -> None:
        spec = seq.spec
        p = spec.params
        self._table_of[slot] = seq.block_ids
        self.table_len[slot] = -1  # the table is written by `rows`
        self.sampler_values[slot] = np.frombuffer(p.sampler_row_f32, np.float32)
        self.seeds[slot] = spec.seed & 0xFFFFFFFF
        self.prompt_len[slot] = len(spec.prompt_token_ids)
        self.min_tokens[slot] = p.min_tokens
        self.needs_processors[slot] = p.uses_penalties or p.uses_logit_edits
        self.truncates[slot] = p.truncates
        self.prompt_logprobs[slot] = p.prompt_logprobs is not None
        self.logprobs[slot] = p.logprobs is not None
        self.greedy[slot] = p.is_greedy

    def _write_table(self, slot: int, table: list[int]) -> None:
        row = self.block_tables[slot]
        row[: len(table)] = table
        row[len(table):] = 0
        self.table_len[slot] = len(table)

    def reset(self) -> None:
        self._last = None
        self._slot_of.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._table_of = [None] * (self.capacity + 1)
