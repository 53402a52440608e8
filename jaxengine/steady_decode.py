"""The decode steady state as row-stable columns, so such a step costs little Python per row.

When a step is a plain decode of every running request (one token each, no prefill chunk, no
draft, no preemption, no request reading its history), the next step, with nothing changed in
between, is the same rows one position further on. `SteadyDecode` keeps what such a step needs
per row, in the rows' order (the scheduler's `running` list): the requests, their ids, live block
tables, specs and output lists, each row's start when the columns were built, and lookups by the
offset k (steps since then): the rows that start a block (and may need one) or fill one at k, and
the offset at which each row reaches its output limit. The scheduler schedules such a step from
them, `advance` appends each row's placeholder (the rows' computed counts are the columns', read
through `Request.num_computed_tokens`), and `resolve` writes each row's token and checks stops
only where the lookups or the stop ids point; the step's `ScheduledSeq`s are built only if
something reads them (the runner and the output processor read `DecodeColumns`). vLLM v1 keeps
its persistent batch's columns for the same reason.

Validity: the columns describe the rows as the last steady step left them once `advance` ran
on it. The scheduler's `epoch` counts every change to running requests outside that cycle (a
finish, a preemption, drafts set, accepted drafts, a draft slot reservation); a steady step whose
epoch is not the scheduler's is never reused, and its advance and resolve take the general
per-row path. Rows whose slot passes their table's end get their block through the block
manager, in row order; if one cannot, the scheduler falls back to its general loop (which then
preempts).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jaxengine.request import Request, RequestSpec

PLACEHOLDER = -1  # as jaxengine.scheduler.PLACEHOLDER (imported from here there)
_PLACEHOLDER_ROW = [PLACEHOLDER]  # the token list of a decode row whose input is in flight (read only)


class SteadySeqs(Sequence):
    """A steady step's `ScheduledSeq`s (a read-only list), built on the first read of a row: the
    steady path's own readers take the columns instead, and len() needs no rows."""

    __slots__ = ("_n", "_make", "_seqs")

    def __init__(self, n: int, make: Callable[[], list]) -> None:
        self._n = n
        self._make: Callable[[], list] | None = make  # builds the rows (what they hold is fixed when it is made)
        self._seqs: list | None = None

    def _rows(self) -> list:
        if self._seqs is None:
            self._seqs, self._make = self._make(), None
        return self._seqs

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._rows()[i]

    def __iter__(self) -> Iterator:
        return iter(self._rows())

    def __eq__(self, other: object) -> bool:
        return self._rows() == (list(other) if isinstance(other, Sequence) else other)

    def __repr__(self) -> str:
        return repr(self._rows())


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeColumns:
    """A steady decode step's rows as columns, for the model runner (the same rows as its
    `SchedulerOutput.seqs`, in order). While the rows stay the same, every step hands the same
    `ids` and `tables` lists: the same list objects mean the same rows, whose tables changed
    since the step before only where `grown` says."""

    ids: list[str]  # [n] each row's request id
    tables: list[list[int]]  # [n] each row's block table (the seqs' `block_ids`, live: read only)
    starts: np.ndarray  # [n] int32 each row's start (its one token's position)
    grown: list[int]  # rows whose table got a block for this step
    in_flight: bool  # every row's token is a placeholder: the step in flight samples it


class SteadyDecode:
    """Row-stable columns of a plain decode step over all running requests (n rows).

    Every row moves one position per step, so a step is named by its offset k from the step the
    columns were built for: row i's start is starts0[i] + k. What happens to a row at a block
    boundary or at its output limit is found from k by lookups built once, not by a scan."""

    def __init__(self, reqs: list[Request], tables: list[list[int]], starts: list[int], block_size: int,
                 epoch: int) -> None:
        n, bs = len(reqs), block_size
        self.reqs = reqs  # [n] the running requests, in order
        self.ids = [r.request_id for r in reqs]  # [n]
        self.tables = tables  # [n] each request's live block table (the block manager's list)
        self.specs: list[RequestSpec] = [r.spec for r in reqs]  # [n]
        self.outs = [r.output_token_ids for r in reqs]  # [n] each request's live output list
        self.block_size = bs
        self.starts0 = starts  # [n] each row's start at offset 0
        self.starts0_i32 = np.asarray(starts, np.int32)  # [n]
        self.k = 0  # offset of the last step scheduled from these columns
        self.advanced_k = -1  # offset of the last step advanced (-1: none yet)
        # rows by start % block_size: at offset k, rows[(-k) % bs] start a block, and
        # rows[(-k - 1) % bs] fill one
        self.by_phase: list[list[int]] = [[] for _ in range(bs)]
        for i, st in enumerate(starts):
            self.by_phase[st % bs].append(i)
        # the offset whose token reaches row i's output limit (its output length is then
        # start + 2 - prompt tokens: the outputs before the start's token, that token, the new one)
        self.limit_k = [r.stop_at_outputs + len(r.prompt_token_ids) - 2 - st for r, st in zip(reqs, starts)]
        self.first_limit_k = min(self.limit_k, default=0)
        self.stop_ids = frozenset().union(*(r.stop_ids for r in reqs))  # every row's stop ids together
        self.epoch = epoch  # the scheduler's epoch the columns hold for
        self.advanced = False  # `advance` ran on the last step built from these columns
        self.resolved = False  # `resolve` ran on it too (its output lists end in real tokens)

    def __len__(self) -> int:
        return len(self.reqs)

    def starting_block(self, k: int) -> list[int]:
        """Rows whose token at offset k is the first of a block (they may need one)."""
        return self.by_phase[-k % self.block_size]

    def starts(self, k: int) -> list[int]:
        """[n] each row's start at offset k."""
        return self.starts0 if k == 0 else list(map(k.__add__, self.starts0))

    def seqs(self, k: int, seq_type: type) -> list:
        """The `ScheduledSeq`s at offset k: one token each, sampling, no copy of the outputs."""
        n = len(self.reqs)
        if self.resolved:  # the last step's tokens are known: each row's input is its last token
            toks = [o[-1:] for o in self.outs]
            return list(map(seq_type, self.ids, self.starts(k), itertools.repeat(1, n), toks, self.tables,
                            itertools.repeat(True, n), self.specs, itertools.repeat(None, n)))
        # Each row's input is the token the step in flight samples. The runner and the output
        # processor read the columns, so the rows are built only if something else reads them.
        return SteadySeqs(n, lambda: list(map(
            seq_type, self.ids, self.starts(k), itertools.repeat(1, n), itertools.repeat(_PLACEHOLDER_ROW, n), self.tables,
            itertools.repeat(True, n), self.specs, itertools.repeat(None, n))))

    def columns(self, k: int, grown: list[int]) -> DecodeColumns:
        """The runner's view of the step at offset k (after `seqs`, before the next `advance`)."""
        return DecodeColumns(self.ids, self.tables, self.starts0_i32 + np.int32(k), grown, not self.resolved)

    def computed(self, i: int) -> int:
        """Row i's computed tokens (`Request.num_computed_tokens` of a row advanced here last)."""
        return self.starts0[i] + self.advanced_k + 1

    def advance(self, k: int, on_filled) -> None:
        """The step at offset k was dispatched: each row's token counts as computed (blocks that
        filled go to `on_filled(request)`) and its output list gets a placeholder. The counts are
        the columns' from the first advance on: each request reads its own from here until
        something else sets it."""
        if self.advanced_k < 0:
            for i, req in enumerate(self.reqs):
                req._steady_row = (self, i)
        self.advanced_k = k
        for outs in self.outs:
            outs.append(PLACEHOLDER)
        # (a filled block holds computed tokens only, so the placeholder is not in it)
        for i in self.by_phase[(-k - 1) % self.block_size]:
            on_filled(self.reqs[i])
        self.advanced, self.resolved = True, False

    def resolve(self, k: int, sampled: list[int]) -> list[int]:
        """The step at offset k returned `sampled` (a token per row): each row's placeholder
        becomes its token. Returns the rows that may end, in order (their output reached its
        limit, or their token is some row's stop id); the others end nothing."""
        for outs, token in zip(self.outs, sampled):
            outs[-1] = token
        self.resolved = True
        rows: list[int] = []
        if k >= self.first_limit_k:
            rows = [i for i, lk in enumerate(self.limit_k) if lk <= k]
        if self.stop_ids and not self.stop_ids.isdisjoint(sampled):
            stop_ids = self.stop_ids
            rows = sorted(set(rows).union(i for i, t in enumerate(sampled) if t in stop_ids))
        return rows
