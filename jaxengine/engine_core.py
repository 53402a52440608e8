"""The engine core: the one owner of a step.

`step()` is schedule -> dispatch -> resolve -> outputs, with the host one step ahead of the
device:

    step k:   schedule N+1 | dispatch N+1 | resolve N (wait for its tokens) | outputs of N
    device:   ... runs N ......... runs N+1 ..................................

1. schedule: the scheduler picks a token budget's worth of work (decode rows first, then
   prefill chunks). Its output, plain data, is the runner's only input. Step N's tokens are not
   known yet: its decode rows carry placeholders, which the device fills from N's samples.
2. dispatch: the runner builds N+1's fixed-shape inputs and enqueues its programs (forward,
   sampler) without waiting.
3. resolve: N's tokens come back (the step's one device-to-host transfer); the scheduler swaps
   them for the placeholders and finishes requests on eos, stop token ids and length. A request
   that N finishes may hold a wasted row in N+1: its token is dropped, and its freed blocks are
   reused only by steps enqueued after N+1.
4. outputs: N goes to the output worker (jaxengine/output_worker.py), whose thread
   detokenizes, applies stop strings, records logprobs and builds the `RequestOutput`s while the
   loop launches N+2's programs and waits for N+1 in the next step; that step takes N's outputs
   after its own resolve and ends the requests N stopped or failed in the scheduler (a request
   stopped by a string at N still samples in N+1 and N+2: those tokens are dropped). A step
   after which nothing is in flight is processed at once, so the last outputs come without an
   extra step.
A request whose sampling reads its output tokens (penalties, bad words of several tokens) does
not make the step wait either: its history's last token, still being sampled by N, is written as
a reference to N's row, and N+1's sampler reads it from N's tokens on the device
(sampler.resolve_history).

Structured outputs: a step with constrained rows is dispatched in two parts. Its forward is
enqueued first; then N resolves, each constrained request's grammar consumes its token (a
rejected token fails that request alone; a grammar that is complete ends it with "stop"), the
host computes the rows' bitmask while the device runs the forward, and the sampler is enqueued
with it. Steps without constrained rows run exactly as before.

Speculative decoding (jaxengine/spec_decode.py): while it is on (few enough unfinished requests,
none that cannot be verified), each step first resolves the one before it, proposes draft tokens
for the running requests (n-gram lookups in their tokens, or the draft model's proposal round on
the device: jaxengine/draft_model.py), and the scheduler gives each draft a slot of its
request's row; the runner verifies them in place of sampling, and a row resolves to 1 to k + 1
tokens. Such steps do not overlap the host with the device: the drafts need the latest tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import numpy as np

from jaxengine.model_runner import InFlight, ModelRunner
from jaxengine.output_processor import OutputProcessor, ProcessedStep, ResolvedStep
from jaxengine.output_worker import OutputWorker
from jaxengine.outputs import RequestOutput
from jaxengine.request import Request, RequestStatus
from jaxengine.sampling_params import SamplingParams
from jaxengine.scheduler import PLACEHOLDER, Scheduler, SchedulerOutput
from jaxengine.spec_decode import ngram_propose

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PooledPrompt:
    """A finished prompt's final hidden states, float32 [D] each: what LAST, CLS and MEAN pooling
    read (mean over every prompt token, chunks included)."""

    last: np.ndarray
    first: np.ndarray
    mean: np.ndarray

PREEMPTION_LOG_INTERVAL_S = 60.0  # at most one warning about preemptions per interval


@dataclasses.dataclass(slots=True)
class _Dispatched:
    sched: SchedulerOutput
    handle: InFlight


@dataclasses.dataclass
class SpecDecodeStats:
    """Speculative decoding so far (vLLM's counters): rows that carried drafts, draft tokens,
    accepted drafts, and accepted drafts by position (the i-th draft of a row)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted row emits on average: its accepted drafts plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class EngineCore:
    """Owns the scheduler, the model runner and the output processor, and steps them together."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor, grammar=None):
        """`grammar`: the structured-output backend (jaxengine.grammar.GrammarBackend) that fills
        constrained rows' bitmasks; None when no request can be constrained."""
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs
        self.worker = OutputWorker(outputs)  # `outputs` is used only under `worker.lock` from here on
        # The worker also runs while the runner launches a program (XLA enqueues it with the GIL
        # released): for a small model the launch is the longest part of the loop's step.
        runner.launch_window = self.worker.loop_waiting
        self.grammar = grammar
        self.spec = runner.spec  # jaxengine.spec_decode.SpeculativeConfig, or None
        self.spec_stats = SpecDecodeStats(accepted_per_pos=[0] * (self.spec.num_speculative_tokens if self.spec else 0))
        # A proposal round that drafts nothing still made its step wait for the one before: after
        # such a dry round the next `_spec_skip` steps run ahead without proposing (1, 3, 7, then
        # 8 after consecutive dry rounds; 0 again once a round drafts).
        self._spec_skip = 0
        self._spec_dry = 0
        self._inflight: _Dispatched | None = None  # the step running on the device
        self._preempted_since_log = 0
        self._preemption_logged_at = float("-inf")
        # Where step time goes: waiting for the device vs everything else (host work).
        self.timing = {"steps": 0, "device_wait_s": 0.0, "step_s": 0.0}
        # Tokens scheduled (prefill + decode): by the last `step()` (0 if it scheduled nothing),
        # and in all, with the number of steps that scheduled any (vLLM's iteration tokens).
        self.last_step_tokens = 0
        self.scheduled_tokens = 0
        self.scheduled_steps = 0
        # Pooling engines: request id -> its prompt's pooled hidden states, kept until the caller
        # takes them (`pop_pooled`); prompts part-way through: [first row, row sum so far].
        self.pooled: dict[str, PooledPrompt] = {}
        self._pool_acc: dict[str, list[np.ndarray]] = {}

    def pop_pooled(self, request_id: str) -> PooledPrompt | None:
        """The request's pooled states (None if it has none); forgets any partial sums too."""
        self._pool_acc.pop(request_id, None)
        return self.pooled.pop(request_id, None)

    def _pool(self, sched: SchedulerOutput, pooled: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """A pooling engine's step: each prompt chunk's first row and row sum accumulate; when a
        prompt's last chunk is done, its `PooledPrompt` is kept for the caller. A chunk from
        position 0 starts over (a preempted prompt is recomputed from the start). The first row
        and the mean are whole only without prefix caching (the pooling engine turns it off for
        CLS and MEAN pooling)."""
        last, first, sums = pooled
        for i, s in enumerate(sched.seqs):
            n_prompt = len(s.spec.prompt_token_ids)
            if s.start >= n_prompt:  # a row after the prompt (the dropped token of a finished request)
                continue
            acc = self._pool_acc.get(s.request_id)
            if s.start == 0 or acc is None:  # (a prefix from the cache starts later: LAST pooling only)
                self._pool_acc[s.request_id] = [first[i], sums[i].copy()]
            else:
                acc[1] += sums[i]
            if s.start + s.num_new_tokens == n_prompt:
                head, total = self._pool_acc.pop(s.request_id)
                self.pooled[s.request_id] = PooledPrompt(last[i], head, total / n_prompt)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, children: list[Request]) -> None:
        """Adds a request as its `children` (one per sampled sequence); all or none are added."""
        added: list[str] = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.scheduler.abort_requests(added)
            raise
        with self.worker.lock:
            self.outputs.add(request_id, prompt, prompt_token_ids, params,
                             [(c.request_id, c.sampling_params) for c in children], children[0].arrival_time)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            with self.worker.lock:
                children = self.outputs.abort(rid)
            self.scheduler.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return self._inflight is not None or self.worker.busy or self.scheduler.has_unfinished_requests()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule and dispatch step N+1, resolve step N, return N's outputs."""
        t_start = time.perf_counter()
        try:
            prev, self._inflight = self._inflight, None
            done = None
            speculate = self.spec is not None and self._speculating()
            if speculate and self._spec_skip:
                self._spec_skip -= 1
                speculate = False
            if prev is not None and (speculate or prev.handle.spec):
                done, prev = self._resolve(prev), None
            if speculate:
                self._propose()
            sched = self.scheduler.schedule()
            self.last_step_tokens = sched.num_batched_tokens
            if sched.num_batched_tokens:
                self.scheduled_tokens += sched.num_batched_tokens
                self.scheduled_steps += 1
            if sched.num_cached_tokens:
                with self.worker.lock:
                    self.outputs.scheduled(sched.num_cached_tokens, time.monotonic())
            if sched.preempted_ids:
                self._log_preemptions(len(sched.preempted_ids))
            dispatched = None
            if sched.seqs:
                constrained = self.scheduler.num_constrained and self._constrained_rows(sched)
                if speculate and any(s.num_drafts for s in sched.seqs):
                    dispatched = _Dispatched(sched, self.runner.dispatch_spec(sched))
                elif constrained:
                    pending = self.runner.dispatch_forward(sched, prev.handle if prev else None)
                    if prev is not None:
                        done, prev = self._resolve(prev), None
                    mask = self.grammar.fill_bitmask(self._constrained_rows(sched), pending.num_rows)
                    dispatched = _Dispatched(sched, self.runner.dispatch_sampler(pending, mask))
                else:
                    dispatched = _Dispatched(sched, self.runner.dispatch(sched, prev.handle if prev else None))
            if prev is not None:
                done = self._resolve(prev)
            if dispatched is not None:
                self.scheduler.advance(sched)
                self._inflight = dispatched
            return self._outputs(done)
        finally:
            self.timing["step_s"] += time.perf_counter() - t_start

    def _speculating(self) -> bool:
        """Whether this step proposes drafts: at most `disable_by_batch_size` unfinished requests,
        none of which needs what verification does not implement (jaxengine/spec_decode.py)."""
        s = self.scheduler
        return 0 < s.num_unfinished <= self.spec.disable_by_batch_size and s.num_unspeculative == 0

    def _propose(self) -> None:
        """Drafts for every running request whose next step is a decode: n-gram lookups on the
        host, or the draft model's proposal round on the device."""
        spec = self.spec
        decoding = [req for req in self.scheduler.running
                    if req.output_token_ids and req.output_token_ids[-1] != PLACEHOLDER
                    and req.num_computed_tokens == req.num_tokens - 1]
        drafted = False
        if self.runner.draft is not None:
            rows = []
            for req in decoding:
                n = self.scheduler.reserve_draft_slots(req, spec.num_speculative_tokens)
                if n:
                    rows.append((req, n, self.scheduler.block_manager.get_block_ids(req.request_id)))
            if rows:
                for (req, _, _), drafts in zip(rows, self.runner.draft.propose(rows)):
                    self.scheduler.set_drafts(req, drafts)
                drafted = True
        else:
            for req in decoding:
                self.scheduler.set_drafts(req, ngram_propose(req.prompt_token_ids + req.output_token_ids,
                                                             spec.num_speculative_tokens, spec.prompt_lookup_min,
                                                             spec.prompt_lookup_max))
                drafted = drafted or bool(req.draft_token_ids)
        if drafted:
            self._spec_dry = 0
        elif decoding:  # requests were decoding and none got a draft: a dry round
            self._spec_dry = min(2 * self._spec_dry + 1, 8)
            self._spec_skip = self._spec_dry

    @staticmethod
    def _constrained_rows(sched: SchedulerOutput) -> list[tuple[object, int]]:
        """(grammar matcher, row) of the step's sampling rows whose request is constrained."""
        return [(req.grammar, i) for i, (s, req) in enumerate(zip(sched.seqs, sched._requests))
                if s.samples and req.grammar is not None and not req.is_finished]

    def _advance_grammars(self, sched: SchedulerOutput, sampled: list[int | None],
                          finished: dict[str, tuple[str, int | str | None]]) -> dict[str, Exception]:
        """Each constrained request's grammar consumes its sampled token. A complete grammar ends
        its request ("stop", added to `finished`); a rejected token is that request's error."""
        errors: dict[str, Exception] = {}
        done: list[str] = []
        for req, token in zip(sched._requests, sampled):
            m = req.grammar
            if m is None or token is None or req.is_finished:
                continue
            if not m.consume_token(token):
                errors[req.request_id] = ValueError(f"structured outputs: the grammar rejected token {token}: "
                                                    f"{m.get_error()}")
            elif m.is_stopped():
                done.append(req.request_id)
                finished[req.request_id] = ("stop", None)
        if done:
            self.scheduler.finish_requests(done, RequestStatus.FINISHED_STOPPED)
        return errors

    def _log_preemptions(self, n: int) -> None:
        """A warning with the count, at most once per interval: preemption costs recomputation."""
        self._preempted_since_log += n
        now = time.monotonic()
        if now - self._preemption_logged_at >= PREEMPTION_LOG_INTERVAL_S:
            logger.warning("%d request(s) preempted for lack of KV cache blocks since the last warning "
                           "(%d in all); they are recomputed later. More KV cache (gpu_memory_utilization, "
                           "num_kv_blocks) or a lower max_num_seqs avoids it.", self._preempted_since_log,
                           self.scheduler.num_preemptions)
            self._preempted_since_log, self._preemption_logged_at = 0, now

    def _resolve(self, step: _Dispatched) -> ResolvedStep:
        """Waits for a dispatched step's tokens and hands them to the scheduler."""
        with self.worker.loop_waiting():  # the output worker processes the step before meanwhile
            t0 = time.perf_counter()
            out = self.runner.collect(step.handle)
            self.timing["device_wait_s"] += time.perf_counter() - t0
        self.timing["steps"] += 1
        sched = step.sched
        if out.pooled is not None:
            self._pool(sched, out.pooled)
        accepted = None
        if out.num_tokens is not None:  # speculative: each row's accepted drafts, then the target's token
            sampled = [toks[:n] if s.samples else None
                       for s, toks, n in zip(sched.seqs, out.token_ids.tolist(), out.num_tokens.tolist())]
            accepted = self._count_accepted(sched, sampled)
        else:
            tokens = out.token_ids.tolist()
            sampled = tokens if sched.all_sample else [tok if s.samples else None for s, tok in zip(sched.seqs, tokens)]
        constrained = self.scheduler.num_constrained
        finished = {r.request_id: (r.status.finish_reason, r.stop_reason)
                    for r in self.scheduler.resolve(sched, sampled)}
        errors = self._advance_grammars(sched, sampled, finished) if constrained else None
        return ResolvedStep(sched, out, sampled, finished, errors, accepted)

    def _count_accepted(self, sched: SchedulerOutput, sampled: list) -> list[int]:
        """Per row, its accepted drafts (0 without drafts), counted into `spec_stats`."""
        st = self.spec_stats
        accepted = []
        for s, toks in zip(sched.seqs, sampled):
            a = len(toks) - 1 if s.num_drafts and toks else 0
            accepted.append(a)
            if s.num_drafts and toks:
                st.num_drafts += 1
                st.num_draft_tokens += s.num_drafts
                st.num_accepted_tokens += a
                for j in range(a):
                    st.accepted_per_pos[j] += 1
        return accepted

    def _outputs(self, done: ResolvedStep | None) -> list[RequestOutput]:
        """The outputs of the step handed to the worker before (processed while this step waited
        for the device), then `done` handed over; `done` is waited for too when nothing is left in
        flight to overlap it with."""
        outputs = self._finish_processed(self.worker.take())
        if done is not None:
            self.worker.submit(done)
            if self._inflight is None:
                outputs += self._finish_processed(self.worker.take())
        return outputs

    def _finish_processed(self, processed: ProcessedStep | None) -> list[RequestOutput]:
        """Ends in the scheduler what output processing stopped (a stop string) or failed."""
        if processed is None:
            return []
        if processed.stopped:
            self.scheduler.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
        if processed.failed:
            self.scheduler.abort_requests(processed.failed)
        return processed.outputs
