"""Per-request output state: incremental text, stop strings, logprobs, and `RequestOutput`s.

A user request with n > 1 fans out into n child requests (ids "<i>_<parent id>") that share the
prompt (and so its prefix-cache blocks); their completions are gathered into one RequestOutput.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxengine.detokenizer import IncrementalDetokenizer, decode_token
from jaxengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxengine.request import Request, RequestStatus
from jaxengine.sampling_params import SamplingParams


@dataclasses.dataclass
class ChildState:
    request: Request
    index: int
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
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

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, children: list[Request]) -> None:
        metrics = RequestMetrics(arrival_time=children[0].arrival_time, first_scheduled_time=None,
                                 first_token_time=None, last_token_time=None, finished_time=None)
        states = []
        for i, child in enumerate(children):
            detok = None
            if self.tokenizer is not None and child.sampling_params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.sampling_params)
            lps = [] if child.sampling_params.logprobs is not None else None
            states.append(ChildState(child, i, detok, lps))
        parent = ParentState(request_id, prompt, prompt_token_ids, params, states, metrics,
                             [None] if params.prompt_logprobs is not None else None)
        self.parents[request_id] = parent
        for st in states:
            st.parent = parent
            self.child_to_parent[st.request.request_id] = parent
            self.child_states[st.request.request_id] = st

    def is_live(self, child_id: str) -> bool:
        """False for a child unknown here or already finished (aborted, stopped one step late)."""
        st = self.child_states.get(child_id)
        return st is not None and st.finish_reason is None

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def process_token(self, child_id: str, token: int, logprob: float | None, rank: int | None,
                      top_ids: np.ndarray | None, top_logprobs: np.ndarray | None,
                      now: float | None = None) -> str | None:
        """Records one new token of a child. Returns a matched stop string, if any.

        The logprob arguments are read only when the child asked for logprobs (else they may be None);
        `now` (time.monotonic) lets a caller take the clock once for a whole step.
        """
        st = self.child_states[child_id]
        metrics = st.parent.metrics
        if now is None:
            now = time.monotonic()
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        params = st.request.sampling_params
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
        req = st.request
        if req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == token \
                and not params.include_stop_str_in_output:
            return None  # the stop token id that ended it: no text (vLLM's rule)
        return st.detok.update_one(token)

    def record_prompt_logprobs(self, child_id: str, start: int, logprob: np.ndarray, rank: np.ndarray,
                               top_ids: np.ndarray, top_logprobs: np.ndarray) -> None:
        """Rows start.. of the prompt (row i predicts prompt token start + i + 1); children share
        the prompt, so the first child records it, and recomputed rows (after preemption) are skipped."""
        parent = self.child_to_parent.get(child_id)
        if parent is None or parent.prompt_logprobs is None or parent.children[0].request.request_id != child_id:
            return
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

    def make_output(self, request_id: str) -> RequestOutput:
        p = self.parents[request_id]
        outs = []
        for c in p.children:  # positional arguments: this runs for every request every streamed step
            outs.append(CompletionOutput(
                c.index, c.detok.output_text if c.detok else "", _settled(c.request.output_token_ids),
                c.cumulative_logprob if c.logprobs is not None else None, c.logprobs, c.finish_reason,
                c.stop_reason))
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, p.prompt_logprobs, outs, p.finished,
                             p.metrics, p.children[0].request.num_cached_tokens)

    def pop_if_finished(self, request_id: str) -> None:
        p = self.parents.get(request_id)
        if p is not None and p.finished:
            del self.parents[request_id]
            for c in p.children:
                self.child_to_parent.pop(c.request.request_id, None)
                self.child_states.pop(c.request.request_id, None)


def _settled(ids: list[int]) -> list[int]:
    """A copy of the output token ids without the placeholder of a step still in flight."""
    return ids[:-1] if ids and ids[-1] < 0 else ids[:]
