"""Speculative decoding: its configuration (vLLM's `speculative_config` keys) and the n-gram proposer.

A speculating request's decode row carries up to k draft tokens after its last token; the
target model computes all 1 + k positions in one step and the verify program
(jaxengine/rejection_sampler.py) keeps the drafts that agree with it plus one token of its own,
so a step emits 1 to k + 1 tokens. Greedy requests get exactly the tokens they get without
speculation; sampled requests get the target's distribution (rejection sampling).

Proposers:
- "ngram" (prompt lookup): the longest suffix of the request's tokens (prompt_lookup_max down to
  prompt_lookup_min tokens) that occurred earlier in them proposes the k tokens that followed
  its most recent earlier occurrence. Host-only, no model: it pays on outputs that copy their
  input (summaries, edits, code changes).
- "draft_model" (`model`: a small model of the target's vocabulary): the draft's own greedy
  tokens, k decode steps of it on the device (jaxengine/draft_model.py). Its paged KV cache
  shares the target's block tables, and it catches up on the tokens it has not seen before it
  proposes, so it costs nothing while speculation is off.

When speculation runs: drafts need the request's latest token, so a step with drafts is
scheduled after the step before it resolved (the engine's synchronous path); above
`disable_by_batch_size` unfinished requests, a step's verification costs more than its drafts
save, so no drafts are proposed and the engine runs ahead asynchronously again. Requests whose
sampling reads logits processors (penalties, logit_bias, allowed_token_ids, bad_words) or a
structured-output grammar never get drafts: those combinations are not implemented, and such a
request simply decodes one token a step (said once in the log).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np

METHODS = ("ngram", "draft_model")
# Unfinished requests above which no drafts are proposed (a step's verification then costs
# more than the drafts save); see docs/speculative_decoding.md.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys that this engine serves."""

    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: drafts per step and request
    prompt_lookup_max: int = 4  # n-gram: longest suffix looked up
    prompt_lookup_min: int = 1  # n-gram: shortest suffix looked up
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE  # no drafts above this many unfinished requests
    model: str | None = None  # draft_model: the draft's HF folder, hub id or (dummy weights) preset name

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.num_speculative_tokens > 8:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most 8, got "
                             f"{self.num_speculative_tokens}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported; supported: "
                             f"{', '.join(METHODS)} (a draft model: {{\"model\": PATH, \"num_speculative_tokens\": k}})")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config: method "draft_model" needs "model" (the draft\'s path or hub id)')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config: "model" names a draft model; it does not go with method "ngram"')

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """From a dict, its JSON text (the command line's form) or None; a ValueError names the key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        if value.get("model") is not None and value.get("method") in (None, "draft_model"):
            value = {**value, "method": "draft_model"}  # vLLM: a model without a method is a draft model
        return cls(**value)


def ngram_propose(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens: those after the most recent earlier occurrence of the longest
    suffix of `tokens` of `max_n` down to `min_n` tokens; [] when no suffix recurs."""
    a = np.asarray(tokens, dtype=np.int64)
    length = len(a)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = a[length - n:]
        # every window of n tokens that starts before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(a[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the most recent occurrence
            return a[start: start + k].tolist()
    return []
