"""Results handed to users, shaped like vLLM's so code written against vLLM reads them unchanged.

One `RequestOutput` per request per engine step (streaming) or at the end (`LLM.generate`); it
holds one `CompletionOutput` per sampled sequence (`n` of them).
"""

from __future__ import annotations

from dataclasses import dataclass


# slots: these are made per request (and per logprob) every step; slots build faster.
@dataclass(slots=True)
class Logprob:
    """The log-probability of one token at one position (from the raw model logits)."""

    logprob: float
    rank: int | None = None  # 1-based rank among the vocabulary at that position
    decoded_token: str | None = None  # the token's text on its own


# Per position, token id -> Logprob (the sampled token plus the requested top ones).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position; the first prompt token has no logprob (None).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request."""

    index: int  # which of the request's n sequences
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs (None unless logprobs asked)
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={'None' if self.logprobs is None else f'<{len(self.logprobs)} positions>'}, "
                f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason!r})")


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic seconds) of one request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: steps whose row carried drafts, the drafts, and those accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted drafts over drafts (None without drafts)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens a drafted step emitted on average: accepted drafts plus the target's own."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: its prompt and every sequence generated so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, "
                f"prompt_logprobs={'None' if self.prompt_logprobs is None else '<...>'}, "
                f"outputs={self.outputs}, finished={self.finished}, "
                f"num_cached_tokens={self.num_cached_tokens})")


# -- pooling (LLM.encode / embed / classify / score) ---------------------------------------------
@dataclass
class PoolingOutput:
    """A pooling request's raw result: `data` is a float32 numpy array (vLLM: a tensor)."""

    data: object


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # normalised unless PoolingParams(normalize=False)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label: softmax over the labels (one label: sigmoid)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float  # cross-encoder: the sigmoid of its logit; embedding model: cosine similarity


@dataclass
class PoolingRequestOutput:
    """One prompt's pooling result; `outputs` is one of the four outputs above."""

    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    finished: bool = True


# vLLM's names for the same shape, one per task.
EmbeddingRequestOutput = ClassificationRequestOutput = ScoringRequestOutput = PoolingRequestOutput
