"""Continuous-batching scheduler: which tokens of which requests the next step computes.

One request's path through it:
1. `add_request` validates it and queues it in `waiting` (FIFO).
2. `schedule()` hands out a token budget (`max_num_batched_tokens`). Running requests go first,
   in order, each getting min(tokens still to compute, budget left): a decoding request has one
   (its last sampled token), a request in the middle of its prompt gets the next chunk. Then
   waiting requests, front first, while there is budget and fewer than `max_num_seqs` run; on
   its first schedule a request looks up its prompt in the prefix cache and starts after the
   cached blocks. Prefill, chunked prefill and decode are all this one rule.
3. When a running request cannot get a block, the newest running request is preempted
   (recompute): its blocks are freed, `num_computed_tokens` drops to 0 and it goes to the front
   of `waiting`, keeping its outputs; later it recomputes prompt + outputs and carries on.
4. The runner computes the step and samples one token for every row that reaches the end of its
   request's tokens. `update_from_output` advances `num_computed_tokens`, appends the tokens,
   registers newly filled blocks in the prefix cache and finishes requests on eos, stop token
   ids, max_tokens or max_model_len, freeing their blocks at once.
Pure Python, never imports JAX: tested in milliseconds.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxengine.block_manager import BlockManager
from jaxengine.request import Request, RequestSpec, RequestStatus
from jaxengine.steady_decode import PLACEHOLDER, DecodeColumns, SteadyDecode

logger = logging.getLogger(__name__)

# PLACEHOLDER (from steady_decode): output token of a dispatched step whose sampled token is not known yet


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # most requests running at once
    max_num_batched_tokens: int  # token budget of one step (prefill chunks + decodes)
    max_model_len: int  # prompt + output tokens of one request
    num_blocks: int  # KV blocks in the device cache, the null block 0 included
    block_size: int  # token slots per block
    enable_prefix_caching: bool = True
    sliding_window: int | None = None  # every layer's attention window: KV blocks before it are freed
    max_loras: int = 0  # most distinct LoRA adapters among the running requests (0: LoRA off)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        capacity = (self.num_blocks - 1) * self.block_size
        if capacity < self.max_model_len:
            # Otherwise one long request could preempt itself forever.
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the KV cache holds "
                f"({self.num_blocks - 1} blocks x {self.block_size} = {capacity} tokens): "
                "lower max_model_len or give the cache more memory"
            )


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: everything the model runner needs for its rows, as plain
    data (the runner never sees a `Request`). Lists are shared, not copied: read only."""

    request_id: str
    start: int  # tokens already in the cache: position of the first new token
    num_new_tokens: int  # tokens computed this step (1 for a decode row)
    token_ids: list[int]  # the new tokens [num_new_tokens]; PLACEHOLDER where the step in flight samples it
    block_ids: list[int]  # the request's whole block table after allocation (live: read only)
    samples: bool  # this step reaches the end of the request's tokens: sample from its last row
    spec: RequestSpec  # the request's sampling parameters, seed and prompt
    output_token_ids: list[int] | None  # a copy of the outputs, only when the sampler reads them (penalties, bad words)
    num_drafts: int = 0  # speculative decoding: the last token_ids are this many draft tokens to verify

    @property
    def is_decode(self) -> bool:
        """The one new token is the last sampled one (the prompt was done before this step)."""
        return self.samples and self.num_new_tokens == 1 and self.start >= len(self.spec.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Of a sampling row: output tokens before the one it samples (its index among the outputs)."""
        return self.start + self.num_new_tokens - self.num_drafts - len(self.spec.prompt_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: the model runner's only input."""

    seqs: list[ScheduledSeq]  # decode rows first, then prefill chunks (the kernel layout)
    num_batched_tokens: int  # sum of num_new_tokens
    preempted_ids: list[str]  # preempted this step (their blocks are free; they recompute later)
    finished_ids: list[str]  # finished or aborted since the last step (their blocks are free)
    # Requests scheduled for the first time this step -> prompt tokens found in the prefix cache.
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    # The scheduler's own handle on each row's request, for `advance` and `resolve` (an id alone
    # could name a newer request by then). Not the runner's: it reads `seqs` only.
    _requests: list[Request] = field(default_factory=list, repr=False)
    # Every row samples (a step of decodes and last prompt chunks): the sampled ids need no
    # per-row check against `seqs`. False is always safe.
    all_sample: bool = False
    # A plain decode of every running request, the same rows as the step before: its rows as
    # columns (the runner reads them instead of each row's fields). None for any other step.
    columns: DecodeColumns | None = None
    # A plain decode of every running request (jaxengine/steady_decode.py): its columns, the
    # step's offset in them, and the scheduler's epoch when it was scheduled. The scheduler's own.
    _steady: SteadyDecode | None = field(default=None, repr=False)
    _offset: int = 0
    _epoch: int = -1


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.sliding_window
        )
        self.waiting: deque[Request] = deque()  # preempted requests at the front
        self.running: list[Request] = []  # oldest first; preemption takes from the tail
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._finished_ids: list[str] = []  # since the last schedule()
        self.num_preemptions = 0  # total
        self._num_reading_history = 0  # unfinished requests whose sampling reads their history
        self.num_constrained = 0  # unfinished requests with a structured-output grammar
        self.num_unspeculative = 0  # unfinished requests whose sampling speculation cannot verify
        # Changes to running requests outside the plain decode cycle (finishes, preemptions,
        # accepted drafts, draft slots): a steady decode's columns hold while it is unchanged.
        self.epoch = 0
        self._steady: SteadyDecode | None = None  # the last step, if it was a steady decode
        self.use_steady = True  # False: every step takes the general loop (tests compare the two)

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, request: Request) -> None:
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        if n >= self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {n} tokens leaves no room to generate "
                f"within max_model_len={self.config.max_model_len}"
            )
        # Implied by the config check (the cache holds max_model_len tokens); kept as a guard.
        if -(-(n + 1) // self.config.block_size) > self.config.num_blocks - 1:
            raise ValueError(
                f"request {request.request_id!r}: {n} prompt tokens need more KV blocks than the "
                f"cache has ({self.config.num_blocks - 1})"
            )
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} has already been scheduled")
        sp = request.sampling_params
        limit = self.config.max_model_len - n
        request.stop_at_outputs = limit if sp.max_tokens is None else min(limit, sp.max_tokens)
        request.stop_ids = frozenset(() if sp.ignore_eos else request.eos_token_ids) | frozenset(sp.stop_token_ids or ())
        self._requests[request.request_id] = request
        self.waiting.append(request)
        if _reads_history(request):
            self._num_reading_history += 1
        if request.grammar is not None:
            self.num_constrained += 1
        if not _speculation_compatible(request):
            self.num_unspeculative += 1

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort waiting or running requests; their blocks are freed now. Unknown ids are ignored."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests for a reason found outside the scheduler (a stop string, an abort)."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        reqs = [r for rid in request_ids if (r := self._requests.get(rid)) is not None]
        for r in reqs:
            while r.output_token_ids and r.output_token_ids[-1] == PLACEHOLDER:
                r.output_token_ids.pop()  # a token of a step in flight that will never be used
            self._finish(r, status)
        if reqs:
            self._drop_finished()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def num_requests_with_lora(self, lora_int_id: int) -> int:
        """Unfinished requests (waiting or running) that run with this LoRA adapter."""
        return sum(1 for r in self._requests.values() if r.lora_int_id == lora_int_id)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        steady = self._steady
        if (steady is not None and steady.advanced and steady.epoch == self.epoch
                and len(self.running) == len(steady)
                and (not self.waiting or len(steady) >= self.config.max_num_seqs)):  # (none to admit)
            out = self._schedule_steady(steady)
            if out is not None:
                return out
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        preempted: list[str] = []
        bm, running = self.block_manager, self.running
        # Runs for every running request every step: the common case (a decode whose slot is
        # already in its last block) is inlined; the rest goes through the block manager.
        tables, bs = bm.tables, self.config.block_size
        add_decode, add_prefill = decodes.append, prefills.append
        decode_reqs: list[Request] = []
        prefill_reqs: list[Request] = []
        any_history = self._num_reading_history > 0  # else no row needs a copy of its outputs
        add_decode_req = decode_reqs.append
        # `running` may lose its tail to preemption inside the loop: iteration ends at its new length.
        for req in running:
            if budget <= 0:
                break
            start = req.num_computed_tokens
            outs = req.output_token_ids
            num_prompt = len(req.prompt_token_ids)
            total = num_prompt + len(outs)
            n = total - start
            if n == 1 and start >= num_prompt and not req.draft_token_ids:
                # A plain decode (the steady state): one token, which samples; a new block only
                # when the slot is past the table.
                table = tables.get(req.request_id)
                if table is None or start >= len(table) * bs:
                    if not bm.allocate_slots(req, 1) and not self._preempt_for(req, 1, preempted):
                        break  # `req` itself was preempted: it was the last one
                    table = tables[req.request_id]
                add_decode(ScheduledSeq(req.request_id, start, 1, outs[-1:], table, True, req.spec,
                                        outs[:] if any_history and req.sampling_params.reads_history else None))
                add_decode_req(req)
                budget -= 1
                continue
            assert n > 0, "schedule() called again before update_from_output()"
            if n > budget:
                n = budget
            table = tables.get(req.request_id)
            if table is None or start + n > len(table) * bs:
                if not bm.allocate_slots(req, n) and not self._preempt_for(req, n, preempted):
                    break  # `req` itself was preempted: it was the last one
                table = tables[req.request_id]
            if start + n == total and n == 1 and start >= num_prompt:
                # speculative decoding: the drafts ride along as extra tokens of the row
                drafts, req.draft_token_ids = req.draft_token_ids, []
                seq = self._with_drafts(req, start, table, drafts[: budget - 1], preempted)
                if seq is None:
                    break  # `req` itself was preempted: it was the last one
                add_decode(seq)
                add_decode_req(req)
                budget -= seq.num_new_tokens
                continue
            add_prefill(self._scheduled(req, n, table))
            prefill_reqs.append(req)
            budget -= n
        num_cached: dict[str, int] = {}
        if not preempted:  # memory is short: let the running requests drain first
            # LoRA: at most max_loras distinct adapters run at once; a request whose adapter would
            # be one too many waits (in order) while later ones go ahead, as vLLM's scheduler does.
            loras = {r.lora_int_id for r in self.running if r.lora_int_id} if self.config.max_loras else set()
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(running) < self.config.max_num_seqs:
                req = self.waiting[0]
                if req.lora_int_id and req.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                    skipped.append(self.waiting.popleft())
                    continue
                seq = self._admit(req, budget)
                if seq is None:
                    break
                self.waiting.popleft()
                if req.lora_int_id:
                    loras.add(req.lora_int_id)
                prefills.append(seq)
                prefill_reqs.append(req)
                budget -= seq.num_new_tokens
                num_cached[req.request_id] = req.num_cached_tokens
            self.waiting.extendleft(reversed(skipped))
        finished, self._finished_ids = self._finished_ids, []
        num_batched = self.config.max_num_batched_tokens - budget
        all_sample = True  # decode rows always sample
        steady = None
        if prefills:
            all_sample = all(s.samples for s in prefills)
            decodes += prefills
            decode_reqs += prefill_reqs
        elif (not preempted and num_batched == len(decodes) == len(running) and self.use_steady
              and not any_history):
            # every running request decodes one token (drafts would make a row longer): the next
            # step is these rows one position on
            steady = SteadyDecode(decode_reqs, [s.block_ids for s in decodes], [s.start for s in decodes],
                                  self.config.block_size, self.epoch)
        self._steady = steady
        out = SchedulerOutput(decodes, num_batched, preempted, finished, num_cached, decode_reqs, all_sample)
        if steady is not None:
            out._steady, out._epoch = steady, self.epoch
        return out

    def _schedule_steady(self, steady: SteadyDecode) -> SchedulerOutput | None:
        """The last step's rows one position on (see jaxengine/steady_decode.py); None when the
        general loop must run instead (no budget for every row, a block not to be had). Drafts
        set since came through `set_drafts`, which changed the epoch."""
        if len(steady) > self.config.max_num_batched_tokens:
            return None
        k = steady.k + 1
        bm, bs = self.block_manager, self.config.block_size
        starts0, tables, grown = steady.starts0, steady.tables, []
        for i in steady.starting_block(k):
            if starts0[i] + k >= len(tables[i]) * bs:
                if not bm.allocate_slots(steady.reqs[i], 1):
                    self._steady = None
                    return None  # the general loop preempts (rows allocated so far keep their block)
                grown.append(i)
        steady.k, steady.advanced = k, False
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(steady.seqs(k, ScheduledSeq), len(steady), [], finished, {}, steady.reqs, True,
                               steady.columns(k, grown), steady, k, self.epoch)

    def draft_room(self, req: Request) -> int:
        """Drafts a decoding request's next step can carry: what max_tokens and max_model_len
        leave room for after the target's own token."""
        sp = req.sampling_params
        room = self.config.max_model_len - req.num_tokens - 1
        if sp.max_tokens is not None:
            room = min(room, sp.max_tokens - len(req.output_token_ids) - 1)
        return max(room, 0)

    def set_drafts(self, req: Request, drafts: list[int]) -> None:
        """Draft tokens proposed for a running request's next step (the next `schedule` takes
        them). The way to set them: a step from the steady decode's columns never looks."""
        self.epoch += 1
        req.draft_token_ids = drafts

    def reserve_draft_slots(self, req: Request, k: int) -> int:
        """Before a draft model proposes for a decoding request: KV slots for its next step with
        up to `k` drafts (the draft writes its KV there while proposing). Returns the drafts it
        may propose; 0 when there is no room or no free block (nothing is preempted for drafts)."""
        n = min(k, self.draft_room(req))
        self.epoch += 1
        if n and not self.block_manager.allocate_slots(req, 1 + n):
            return 0
        return n

    def _with_drafts(self, req: Request, start: int, table: list[int] | None, drafts: list[int],
                     preempted: list[str]) -> ScheduledSeq | None:
        """A decode row that also computes `drafts` (cut to what max_tokens and max_model_len
        leave room for), with KV slots for all of them; None if `req` was preempted."""
        drafts = drafts[: self.draft_room(req)]
        n = 1 + len(drafts)
        if table is None or start + n > len(table) * self.config.block_size:
            if not self.block_manager.allocate_slots(req, n) and not self._preempt_for(req, n, preempted):
                return None
            table = self.block_manager.tables[req.request_id]
        return ScheduledSeq(req.request_id, start, n, req.output_token_ids[-1:] + drafts, table, True, req.spec,
                            None, len(drafts))

    def _preempt_for(self, req: Request, n: int, preempted: list[str]) -> bool:
        """Preempt from the tail until `req` gets its `n` slots; False if `req` went itself."""
        while not self.block_manager.allocate_slots(req, n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _admit(self, req: Request, budget: int) -> ScheduledSeq | None:
        """Move the head of `waiting` to `running` with its first chunk, or None if no blocks."""
        bm = self.block_manager
        blocks, num_cached = bm.get_computed_blocks(req)
        n = min(req.num_tokens - num_cached, budget)
        if not bm.allocate_slots(req, n, blocks):
            return None
        if req.status is RequestStatus.WAITING:  # first schedule (not a resumed preemption)
            req.num_cached_tokens = num_cached
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return self._scheduled(req, n)

    def _scheduled(self, req: Request, n: int, block_ids: list[int] | None = None) -> ScheduledSeq:
        """`req`'s next `n` tokens as a step's row (prefill chunks and first schedules)."""
        start = req.num_computed_tokens
        if block_ids is None:
            block_ids = self.block_manager.get_block_ids(req.request_id)
        return ScheduledSeq(req.request_id, start, n, req.token_ids_slice(start, start + n), block_ids,
                            start + n == req.num_tokens, req.spec,
                            req.output_token_ids[:] if req.sampling_params.reads_history else None)

    def _preempt(self, req: Request) -> None:
        self.epoch += 1
        self.block_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.draft_computed, req.draft_written, req.draft_token_ids = 0, [], []
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        logger.debug("preempted %s (%d tokens to recompute)", req.request_id, req.num_tokens)

    # ------------------------------------------------------------------ results of a step
    def update_from_output(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Request]:
        """Apply a step's results; return the requests it finished (their blocks are freed).

        `sampled[i]` is the token sampled for `out.seqs[i]` (None where `samples` is False).
        Rows of requests finished in between (aborted, stop string) are skipped. This is
        `advance` then `resolve`, for a caller that waits for each step before the next.
        """
        self.advance(out)
        return self.resolve(out, sampled)

    def advance(self, out: SchedulerOutput) -> None:
        """Right after a step is dispatched: its tokens count as computed, and each sampling row
        gets a PLACEHOLDER output token, so the next step can be scheduled before this one's
        tokens are known (the runner feeds them from the device)."""
        steady = out._steady
        if steady is not None and out._epoch == self.epoch:  # every row still runs
            steady.advance(out._offset, self.block_manager.cache_full_blocks)
            return
        bm, bs, running = self.block_manager, self.config.block_size, RequestStatus.RUNNING
        all_sample = out.all_sample
        for seq, req in zip(out.seqs, out._requests):
            if req.status is not running:
                continue
            start = seq.start
            end = start + seq.num_new_tokens - seq.num_drafts  # drafts count once verified (`resolve`)
            req.num_computed_tokens = end
            if end // bs != start // bs:  # a block was filled: offer it to the prefix cache
                bm.cache_full_blocks(req)
            if all_sample or seq.samples:
                req.output_token_ids.append(PLACEHOLDER)

    def resolve(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Request]:
        """When a dispatched step's tokens arrive: they replace the placeholders, and requests end
        on eos / stop ids / length. Requests preempted meanwhile keep their (real) token."""
        if len(sampled) != len(out.seqs):
            raise ValueError(f"{len(sampled)} sampled tokens for {len(out.seqs)} scheduled rows")
        finished: list[Request] = []
        now = time.monotonic()
        steady = out._steady
        if steady is not None and out._epoch == self.epoch:  # no row finished or was preempted since
            # (every row's first token was resolved by an earlier step: it was a plain decode)
            for i in steady.resolve(out._offset, sampled):
                req = steady.reqs[i]
                status = self._check_stop(req, sampled[i])
                if status is not None:
                    self._finish(req, status, now)
                    finished.append(req)
            if finished:
                self._drop_finished()
            return finished
        running = RequestStatus.RUNNING
        check_samples = not out.all_sample
        for seq, req, token in zip(out.seqs, out._requests, sampled):
            status = req.status
            if (check_samples and not seq.samples) or (status is not running and status.is_finished):
                continue
            assert token is not None, f"no token sampled for {req.request_id}"
            outs = req.output_token_ids
            assert outs and outs[-1] == PLACEHOLDER, req.request_id
            if req.first_token_time is None:
                req.first_token_time = now
            if isinstance(token, list):  # speculative decoding: accepted drafts, then the target's token
                status = self._resolve_tokens(req, seq, token)
            else:
                outs[-1] = token
                if len(outs) < req.stop_at_outputs and token not in req.stop_ids:
                    continue  # ends nothing (what `_check_stop` would find, without the call)
                status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status, now)
                finished.append(req)
        if finished:
            self._drop_finished()
        return finished

    def _resolve_tokens(self, req: Request, seq: ScheduledSeq, tokens: list[int]) -> RequestStatus | None:
        """A speculative row's tokens: the accepted drafts' KV counts as computed (their blocks
        are offered to the prefix cache only now, hashed over verified tokens); tokens after one
        that ends the request are dropped. `tokens` is trimmed in place to those kept."""
        outs = req.output_token_ids
        outs.pop()  # the placeholder
        status = None
        for j, t in enumerate(tokens):
            outs.append(t)
            status = self._check_stop(req, t)
            if status is not None:
                del tokens[j + 1:]
                break
        if status is None:
            accepted = len(tokens) - 1
            self.epoch += 1
            start = req.num_computed_tokens
            req.num_computed_tokens = start + accepted
            bs = self.config.block_size
            if accepted and (start + accepted) // bs != start // bs:
                self.block_manager.cache_full_blocks(req)
        return status

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """Why the request ends after sampling `token`, or None. A stop beats a length cap."""
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(req.prompt_token_ids) + n_out >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        """Mark finished and free the blocks; `_drop_finished` then clears the queues."""
        self.epoch += 1
        req.status = status
        req.finished_time = time.monotonic() if now is None else now
        self.block_manager.free(req)
        del self._requests[req.request_id]
        self._finished_ids.append(req.request_id)
        if _reads_history(req):
            self._num_reading_history -= 1
        if req.grammar is not None:
            self.num_constrained -= 1
        if not _speculation_compatible(req):
            self.num_unspeculative -= 1

    def _drop_finished(self) -> None:
        self.running = [r for r in self.running if not r.status.is_finished]
        if any(r.status.is_finished for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.status.is_finished)


def _speculation_compatible(req: Request) -> bool:
    """Whether the verify program samples this request as the sampler would: not with penalties,
    logit edits, a grammar or min_tokens (the sampler's processors and per-step bans)."""
    p = req.sampling_params
    return not (getattr(p, "uses_penalties", False) or getattr(p, "uses_logit_edits", False)
                or getattr(p, "structured_outputs", None) is not None or getattr(p, "min_tokens", 0)
                or req.grammar is not None)


def _reads_history(req: Request) -> bool:
    return bool(getattr(req.sampling_params, "reads_history", False))
