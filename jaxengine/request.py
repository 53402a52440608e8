"""One generation request as the scheduler sees it: token ids, progress and status.

A request's tokens are its prompt followed by its sampled outputs. `num_computed_tokens`
counts the leading tokens whose K/V are in the cache; the scheduler's single rule is to
make it catch up with `num_tokens` (prefill and decode alike). Pure Python, no JAX.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxengine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life. Finished states map to OpenAI's `finish_reason`."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # blocks freed, waiting to recompute prompt + outputs
    FINISHED_STOPPED = enum.auto()  # eos, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # cancelled by the user / client

    # Read for every request every step: plain member attributes (set below), since hashing an
    # enum member runs Python code.
    @property
    def is_finished(self) -> bool:
        return self._is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort" for finished states, None otherwise."""
        return self._finish_reason


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
for _status in RequestStatus:
    _status._is_finished = _status in _FINISH_REASONS
    _status._finish_reason = _FINISH_REASONS.get(_status)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What never changes of a request and the model runner reads: how it samples, from which prompt."""

    params: SamplingParams
    seed: int  # sampling seed: the params' own, or one the engine drew for the request
    prompt_token_ids: list[int]  # shared with the request: never mutated
    lora_int_id: int = 0  # the LoRA adapter the request runs with (0: none)


@dataclass(eq=False)
class Request:
    """A request's tokens and progress. Identity equality: two requests are never 'equal'."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # the model's eos ids (ignored when ignore_eos)
    seed: int = 0  # sampling seed: the params' own, or one the engine drew for the request
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)  # one more per sampling step
    _num_computed: int = field(default=0, repr=False)  # `num_computed_tokens` unless `_steady_row` holds it
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    first_token_time: float | None = None
    finished_time: float | None = None
    # Chained hashes of the request's full blocks, in order; filled lazily and owned by the
    # block manager. Tokens are append-only, so the hashes stay valid across preemption.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    lora_int_id: int = 0  # the LoRA adapter (0: none); part of every block hash, so no cross-adapter sharing
    # Structured outputs: the request's grammar matcher (an llguidance LLMatcher, jaxengine/grammar.py)
    # at the state after its output tokens so far; None when its output is unconstrained.
    grammar: object | None = field(default=None, repr=False)
    # Speculative decoding: draft tokens proposed for the request's next step (the scheduler takes
    # them); set through `Scheduler.set_drafts`, which tells its steady decode they changed.
    draft_token_ids: list[int] = field(default_factory=list, repr=False)
    # Draft-model speculation (jaxengine/draft_model.py): leading tokens whose KV is in the draft's
    # cache, and the drafts whose KV the last proposal wrote after them (unconfirmed until the
    # next proposal compares them with the tokens). A preemption resets both.
    draft_computed: int = field(default=0, repr=False)
    draft_written: list[int] = field(default_factory=list, repr=False)
    # Set by the scheduler when it accepts the request: the output length at which it ends
    # (max_tokens or max_model_len) and the ids that can end it (eos unless ignored, stop ids), so
    # resolving a token that ends nothing reads two attributes.
    stop_at_outputs: int = field(default=0, repr=False)
    stop_ids: frozenset[int] = field(default=frozenset(), repr=False)
    spec: RequestSpec = field(init=False, repr=False)
    # While the request is a row of the scheduler's steady decode (jaxengine/steady_decode.py):
    # (its columns, its row), which hold its computed count, so a steady step writes none.
    _steady_row: tuple | None = field(default=None, init=False, repr=False)

    @property
    def num_computed_tokens(self) -> int:
        """Leading tokens whose K/V are in the cache."""
        row = self._steady_row
        return self._num_computed if row is None else row[0].computed(row[1])

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self._steady_row = None
        self._num_computed = value

    def __post_init__(self) -> None:
        self.spec = RequestSpec(self.sampling_params, self.seed, self.prompt_token_ids, self.lora_int_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens: the target `num_computed_tokens` catches up to."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list of prompt + output token ids."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
