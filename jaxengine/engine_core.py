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
4. outputs: the output processor detokenizes, applies stop strings, records logprobs and builds
   the `RequestOutput`s while the device runs N+1; requests it stops or fails are ended in the
   scheduler.
When a running request uses penalties or bad words of several tokens (which read its output
tokens) the step resolves N before scheduling N+1, as a synchronous engine would.

Structured outputs: a step with constrained rows is dispatched in two parts. Its forward is
enqueued first; then N resolves, each constrained request's grammar consumes its token (a
rejected token fails that request alone; a grammar that is complete ends it with "stop"), the
host computes the rows' bitmask while the device runs the forward, and the sampler is enqueued
with it. Steps without constrained rows run exactly as before.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import numpy as np

from jaxengine.model_runner import InFlight, ModelRunner
from jaxengine.output_processor import OutputProcessor, ResolvedStep
from jaxengine.outputs import RequestOutput
from jaxengine.request import Request, RequestStatus
from jaxengine.sampling_params import SamplingParams
from jaxengine.scheduler import Scheduler, SchedulerOutput

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


class EngineCore:
    """Owns the scheduler, the model runner and the output processor, and steps them together."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor, grammar=None):
        """`grammar`: the structured-output backend (jaxengine.grammar.GrammarBackend) that fills
        constrained rows' bitmasks; None when no request can be constrained."""
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs
        self.grammar = grammar
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
        self.outputs.add(request_id, prompt, prompt_token_ids, params,
                         [(c.request_id, c.sampling_params) for c in children], children[0].arrival_time)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.scheduler.abort_requests(self.outputs.abort(rid))

    def has_unfinished_requests(self) -> bool:
        return self._inflight is not None or self.scheduler.has_unfinished_requests()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule and dispatch step N+1, resolve step N, return N's outputs."""
        t_start = time.perf_counter()
        try:
            prev, self._inflight = self._inflight, None
            done = None
            if prev is not None and self.scheduler.running_reads_history():
                done, prev = self._resolve(prev), None
            sched = self.scheduler.schedule()
            self.last_step_tokens = sched.num_batched_tokens
            if sched.num_batched_tokens:
                self.scheduled_tokens += sched.num_batched_tokens
                self.scheduled_steps += 1
            if sched.num_cached_tokens:
                self.outputs.scheduled(sched.num_cached_tokens, time.monotonic())
            if sched.preempted_ids:
                self._log_preemptions(len(sched.preempted_ids))
            dispatched = None
            if sched.seqs:
                constrained = self.scheduler.num_constrained and self._constrained_rows(sched)
                if constrained:
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
            return self._outputs(done) if done is not None else []
        finally:
            self.timing["step_s"] += time.perf_counter() - t_start

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
        t0 = time.perf_counter()
        out = self.runner.collect(step.handle)
        self.timing["device_wait_s"] += time.perf_counter() - t0
        self.timing["steps"] += 1
        sched = step.sched
        if out.pooled is not None:
            self._pool(sched, out.pooled)
        sampled = [tok if s.samples else None for s, tok in zip(sched.seqs, out.token_ids.tolist())]
        constrained = self.scheduler.num_constrained
        finished = {r.request_id: (r.status.finish_reason, r.stop_reason)
                    for r in self.scheduler.resolve(sched, sampled)}
        errors = self._advance_grammars(sched, sampled, finished) if constrained else None
        return ResolvedStep(sched, out, sampled, finished, errors)

    def _outputs(self, done: ResolvedStep) -> list[RequestOutput]:
        processed = self.outputs.process(done)
        if processed.stopped:
            self.scheduler.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
        if processed.failed:
            self.scheduler.abort_requests(processed.failed)
        return processed.outputs
