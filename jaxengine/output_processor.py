"""Output processing: from a step's sampled tokens to `RequestOutput`s.

For every row of a resolved step that sampled a token, the request's own copy of its tokens
grows by one, its logprobs are recorded (raw, as vLLM reports them), its text is detokenized
incrementally and searched for stop strings. A stop string ends the sequence here; the engine
core then finishes it in the scheduler. Whatever raises while one request is processed (its
detokenizer, NaN logits) fails that request alone, with finish_reason "error", and every other
request goes on.

A user request with n > 1 fans out into n child requests (ids "<i>_<parent id>") that share the
prompt (and so its prefix-cache blocks); their completions are gathered into one RequestOutput.
This module reads no `Request`: only the scheduler's output, the runner's output and what the
scheduler reported finished, so it runs away from the step loop, on the output worker's thread
(jaxengine/output_worker.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from jaxengine.detokenizer import IncrementalDetokenizer, decode_token
from jaxengine.model_runner import RunnerOutput
from jaxengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxengine.sampling_params import SamplingParams
from jaxengine.scheduler import ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class ResolvedStep:
    """A step whose tokens are back on the host: the input of output processing."""

    sched: SchedulerOutput
    out: RunnerOutput
    sampled: list[int | None]  # per row of sched.seqs: its token, None where it did not sample
    # Child requests the scheduler finished on this step's tokens (eos, stop token ids, length):
    # id -> (finish_reason, stop_reason).
    finished: dict[str, tuple[str, int | str | None]]
    # Child requests whose structured-output grammar rejected their token: id -> the error.
    errors: dict[str, Exception] | None = None
    # Speculative steps: per row, the drafts the verify accepted (0 for rows without drafts).
    accepted: list[int] | None = None


@dataclasses.dataclass(slots=True)
class ProcessedStep:
    """What output processing hands back to the engine core."""

    outputs: list[RequestOutput]  # one per request that changed (finished ones only, unless emit_unfinished)
    stopped: list[str]  # child ids that matched a stop string: the scheduler must finish them
    failed: list[str]  # child ids of requests that failed here: the scheduler must abort them


@dataclasses.dataclass(slots=True)
class ChildState:
    request_id: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    token_ids: list[int] = dataclasses.field(default_factory=list)  # resolved output tokens
    cumulative_logprob: float = 0.0  # summed only when logprobs are asked for (reported only then)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    parent: ParentState | None = None  # set by `OutputProcessor.add`


@dataclasses.dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState]
    metrics: RequestMetrics
    # vLLM layout: None for the first prompt token, then {token: Logprob} per later prompt token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served (first schedule)
    # Children whose finish_reason is still None (kept by `OutputProcessor.finish_child`), so
    # `finished`, read for every request every step, needs no scan.
    num_unfinished: int = -1

    def __post_init__(self) -> None:
        if self.num_unfinished < 0:
            self.num_unfinished = sum(c.finish_reason is None for c in self.children)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, ParentState] = {}
        self.child_states: dict[str, ChildState] = {}  # child id -> its state (no scans per token)
        # Request id -> why it failed, for requests finished with finish_reason "error"; the
        # caller pops its entry once it has reported the failure.
        self.errors: dict[str, str] = {}
        # False: `process` returns outputs of finished requests only (offline batch use needs no
        # per-token snapshots); the server streams, so it keeps True.
        self.emit_unfinished = True

    # -- requests -------------------------------------------------------------------------
    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            children: list[tuple[str, SamplingParams]], arrival_time: float) -> None:
        """Starts following a request whose `children` (id, params) were added to the scheduler."""
        states = []
        for i, (child_id, child_params) in enumerate(children):
            detok = None
            if self.tokenizer is not None and child_params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child_params)
            lps = [] if child_params.logprobs is not None else None
            states.append(ChildState(child_id, i, child_params, detok, lps))
        parent = ParentState(request_id, prompt, prompt_token_ids, params, states, RequestMetrics(arrival_time),
                             [None] if params.prompt_logprobs is not None else None)
        self.parents[request_id] = parent
        for st in states:
            st.parent = parent
            self.child_to_parent[st.request_id] = parent
            self.child_states[st.request_id] = st

    def is_live(self, child_id: str) -> bool:
        """False for a child unknown here or already finished (aborted, stopped one step late)."""
        st = self.child_states.get(child_id)
        return st is not None and st.finish_reason is None

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request_id for c in parent.children] if parent else []

    def finish_child(self, child_id: str, finish_reason: str, stop_reason: int | str | None) -> None:
        parent = self.child_to_parent.get(child_id)
        if parent is None:
            return
        st = self.child_states[child_id]
        if st.finish_reason is None:
            parent.num_unfinished -= 1
        st.finish_reason, st.stop_reason = finish_reason, stop_reason
        if parent.finished:
            parent.metrics.finished_time = time.monotonic()

    def abort(self, request_id: str) -> list[str]:
        """Ends a request with finish_reason "abort"; returns its child ids (for the scheduler)."""
        children = self.child_ids(request_id)
        for cid in children:
            self.finish_child(cid, "abort", None)
        self.pop_if_finished(request_id)
        return children

    def make_output(self, request_id: str) -> RequestOutput:
        p = self.parents[request_id]
        outs = []
        for c in p.children:  # positional arguments: this runs for every request every streamed step
            outs.append(CompletionOutput(
                c.index, c.detok.output_text if c.detok else "", c.token_ids[:],
                c.cumulative_logprob if c.logprobs is not None else None, c.logprobs, c.finish_reason,
                c.stop_reason))
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, p.prompt_logprobs, outs, p.finished,
                             p.metrics, p.num_cached_tokens)

    def pop_if_finished(self, request_id: str) -> None:
        p = self.parents.get(request_id)
        if p is not None and p.finished:
            del self.parents[request_id]
            for c in p.children:
                self.child_to_parent.pop(c.request_id, None)
                self.child_states.pop(c.request_id, None)

    # -- one step -------------------------------------------------------------------------
    def scheduled(self, num_cached_tokens: dict[str, int], now: float) -> None:
        """Requests (child ids) admitted by the step just scheduled -> prompt tokens the prefix
        cache served: the first admission of each request is its first scheduled time."""
        for cid, n_cached in num_cached_tokens.items():
            parent = self.child_to_parent.get(cid)
            if parent is not None and parent.num_cached_tokens is None:
                parent.num_cached_tokens = n_cached
                parent.metrics.first_scheduled_time = now

    def process(self, step: ResolvedStep) -> ProcessedStep:
        """Records a resolved step's tokens; returns the outputs and what the scheduler must end."""
        sched, out = step.sched, step.out
        touched: list[ChildState] = []  # children that got a token
        stopped: list[str] = []
        failed: dict[str, Exception] = {}  # parent id -> what broke while processing its output
        if out.prompt_lp is not None:
            self._record_prompt_logprobs(sched.seqs, out.prompt_lp, failed)
        # Runs for every sampled row every step: the clock is read once, NaN flags are looked at
        # only when some row has one, and logprob arrays are indexed only for rows that want them.
        states, finished = self.child_states, step.finished
        nan_rows = out.nan_rows if out.nan_rows is not None and out.nan_rows.any() else None
        errors = step.errors or {}
        now = time.monotonic()
        # (a steady decode step's ids come from its columns: its rows are never built then)
        row_ids = sched.columns.ids if sched.columns is not None else [s.request_id for s in sched.seqs]
        for i, (cid, token) in enumerate(zip(row_ids, step.sampled)):
            if token is None:
                continue
            st = states.get(cid)
            if st is None or st.finish_reason is not None:  # unknown, aborted or stopped a step ago
                continue
            pid = st.parent.request_id
            if nan_rows is not None and nan_rows[i]:
                failed.setdefault(pid, FloatingPointError("the model produced NaN logits for this request"))
            if errors and cid in errors:
                failed.setdefault(pid, errors[cid])
            if failed and pid in failed:
                continue
            ended = finished.get(cid)
            try:
                if isinstance(token, list):  # speculative: several tokens (the scheduler kept these)
                    stop = self._process_tokens(st, token, ended, out, i, now)
                    s = sched.seqs[i]
                    if step.accepted is not None and s.num_drafts:
                        m = st.parent.metrics
                        m.spec_num_draft_tokens += s.num_drafts
                        m.spec_num_accepted_tokens += step.accepted[i]
                        m.spec_num_drafts += 1
                elif st.logprobs is None:
                    stop = self._process_token(st, token, ended, None, None, None, None, now)
                else:
                    stop = self._process_token(st, token, ended, out.logprob[i], out.rank[i], out.top_ids[i],
                                               out.top_logprobs[i], now)
            except Exception as e:  # noqa: BLE001 - one request's failure (e.g. its detokenizer) is its own
                failed.setdefault(pid, e)
                continue
            if ended is not None:
                self.finish_child(cid, *ended)
            elif stop is not None:
                stopped.append(cid)
                self.finish_child(cid, "stop", stop)
            touched.append(st)
        failed_children: list[str] = []
        results = []
        for rid, e in failed.items():
            failed_children += self.child_ids(rid)
            results.append(self._fail(rid, e))
        seen = set(failed)
        emit_unfinished = self.emit_unfinished
        for st in touched:
            parent = st.parent
            if not (emit_unfinished or parent.finished) or parent.request_id in seen:
                continue
            seen.add(parent.request_id)
            try:
                results.append(self.make_output(parent.request_id))
            except Exception as e:  # noqa: BLE001 - as above: only this request fails
                failed_children += self.child_ids(parent.request_id)
                results.append(self._fail(parent.request_id, e))
                continue
            self.pop_if_finished(parent.request_id)
        return ProcessedStep(results, stopped, failed_children)

    def _process_tokens(self, st: ChildState, tokens: list[int], ended: tuple[str, int | str | None] | None,
                        out, i: int, now: float) -> str | None:
        """A speculative row's tokens in order (logprobs from position j of row i); the first stop
        string ends it, and the tokens after it are dropped from the output."""
        last = len(tokens) - 1
        for j, token in enumerate(tokens):
            end = ended if j == last else None
            if st.logprobs is None:
                stop = self._process_token(st, token, end, None, None, None, None, now)
            else:
                stop = self._process_token(st, token, end, out.logprob[i][j], out.rank[i][j], out.top_ids[i][j],
                                           out.top_logprobs[i][j], now)
            if stop is not None:
                return stop
        return None

    def _process_token(self, st: ChildState, token: int, ended: tuple[str, int | str | None] | None,
                       logprob: float | None, rank: int | None, top_ids: np.ndarray | None,
                       top_logprobs: np.ndarray | None, now: float) -> str | None:
        """Records one new token of a child; returns the stop string it completes, if any.

        The logprob arguments are read only when the child asked for logprobs. `ended`: why the
        scheduler finished the child on this token, if it did."""
        metrics = st.parent.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        st.token_ids.append(token)
        params = st.params
        if st.logprobs is not None:
            st.cumulative_logprob += float(logprob)
            entry: dict[int, Logprob] = {}
            for j in range(params.logprobs):
                tid = int(top_ids[j])
                entry[tid] = Logprob(float(top_logprobs[j]), j + 1, self._decode(tid))
            entry[token] = Logprob(float(logprob), int(rank), self._decode(token))
            st.logprobs.append(entry)
        if st.detok is None:
            return None
        if ended is not None and ended[1] == token and not params.include_stop_str_in_output:
            return None  # the stop token id that ended it: no text (vLLM's rule)
        return st.detok.update_one(token)

    def _record_prompt_logprobs(self, seqs: list[ScheduledSeq], prompt_lp: tuple,
                                failed: dict[str, Exception]) -> None:
        """Rows start.. of a prompt (row i predicts prompt token start + i + 1). Children share the
        prompt, so the first child records it; rows recomputed after preemption are skipped."""
        lp, rank, top_ids, top_lps = prompt_lp
        cursor = 0
        for s in seqs:
            rows = slice(cursor, cursor + s.num_new_tokens)
            cursor += s.num_new_tokens
            if s.spec.params.prompt_logprobs is None or s.start >= len(s.spec.prompt_token_ids):
                continue
            parent = self.child_to_parent.get(s.request_id)
            if parent is None or parent.prompt_logprobs is None or parent.children[0].request_id != s.request_id:
                continue
            try:
                self._prompt_rows(parent, s.start, lp[rows], rank[rows], top_ids[rows], top_lps[rows])
            except Exception as e:  # noqa: BLE001 - this request fails alone
                failed.setdefault(parent.request_id, e)

    def _prompt_rows(self, parent: ParentState, start: int, logprob: np.ndarray, rank: np.ndarray,
                     top_ids: np.ndarray, top_logprobs: np.ndarray) -> None:
        k = parent.params.prompt_logprobs
        ids = parent.prompt_token_ids
        for i in range(len(logprob)):
            pos = start + i + 1  # the prompt token this row predicts
            if pos >= len(ids) or pos < len(parent.prompt_logprobs):
                continue
            entry: dict[int, Logprob] = {}
            for j in range(k):
                tid = int(top_ids[i, j])
                entry[tid] = Logprob(float(top_logprobs[i, j]), j + 1, self._decode(tid))
            entry[ids[pos]] = Logprob(float(logprob[i]), int(rank[i]), self._decode(ids[pos]))
            parent.prompt_logprobs.append(entry)

    def _decode(self, token: int) -> str | None:
        return decode_token(self.tokenizer, token) if self.tokenizer is not None else None

    def _fail(self, request_id: str, error: Exception) -> RequestOutput:
        """Ends one request whose output processing raised: its sequences end with finish_reason
        "error" and the error is kept in `errors`. Returns the request's final output; its
        children must still be aborted in the scheduler (their blocks freed)."""
        logger.error("request %s failed: %s: %s", request_id, type(error).__name__, error, exc_info=error)
        for cid in self.child_ids(request_id):
            if self.is_live(cid):
                self.finish_child(cid, "error", None)
        self.errors[request_id] = f"{type(error).__name__}: {error}"
        try:
            final = self.make_output(request_id)
        except Exception:  # noqa: BLE001 - the state itself is broken: report no text
            p = self.parents[request_id]
            final = RequestOutput(request_id, p.prompt, p.prompt_token_ids, None,
                                  [CompletionOutput(c.index, "", [], None, None, c.finish_reason, c.stop_reason)
                                   for c in p.children], True, p.metrics)
        self.pop_if_finished(request_id)
        return final
