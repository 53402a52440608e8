"""`PoolingParams`: how one pooling request's vector is finished, with vLLM's names.

Validated at construction (a bad value is a `ValueError` naming the field, HTTP 400 on the
server). None means "the model's default": embeddings are L2-normalised unless the model's
sentence-transformers config says otherwise; class scores go through softmax (one label:
sigmoid).
"""

from __future__ import annotations

import dataclasses
import numbers

POOLING_TASKS = ("embed", "encode", "classify", "score")


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    normalize: bool | None = None  # embeddings: L2-normalise (None: the model's default)
    dimensions: int | None = None  # embeddings: keep the first k dimensions (Matryoshka), then normalise
    activation: bool | None = None  # classify / score: softmax or sigmoid over the logits (None: on)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the model's limit)
    task: str | None = None  # set by LLM.embed / classify / score / encode

    def __post_init__(self) -> None:
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean or None, got {value!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
