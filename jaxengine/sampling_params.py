"""User-facing sampling parameters, with vLLM's field names, defaults and validation.

`SamplingParams` is validated once, at construction: bad user input raises `ValueError` with a
message naming the field (the server turns it into HTTP 400). Values are normalised there too
(`stop` becomes a list, `top_k=-1` becomes 0, a near-zero temperature means greedy and resets
top-p / top-k / min-p to neutral), so the engine and the sampler read one canonical form.

The dataclass is frozen: derive variants with `dataclasses.replace(params, ...)` (which
re-validates) or copy with `clone()`.
"""

from __future__ import annotations

import copy
import enum
import functools
import logging
import math
import numbers
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

# Below this temperature sampling is greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5
# Positive temperatures below this are raised to it: dividing logits by a tinier number
# overflows float32 into inf / nan.
MIN_POSITIVE_TEMPERATURE = 1e-2
# Most top logprobs a request may ask for, per sampled or prompt token. The sampler always
# computes this many, so it is a compile-time constant.
MAX_LOGPROBS = 20
# Most sequences one request may fan out into.
MAX_N = 1024


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _check_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass, but `n=True` is a bug in the caller, not a count.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} ({value!r}).")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} ({value!r}).")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value}.")


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {type(value).__name__} ({value!r}).")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completion(s). Field meanings follow vLLM / OpenAI."""

    n: int = 1  # completions to return for the prompt
    best_of: int | None = None  # accepted for compatibility; must be None or equal to n
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from logits of tokens seen in the output
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0; > 1 discourages tokens of prompt + output
    temperature: float = 1.0  # [0, 2]; < 1e-5 means greedy
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 (or -1 on input) = off
    min_p: float = 0.0  # [0, 1]; 0 = off
    seed: int | None = None  # per-request seed (-1 on input = None)
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int], duplicates removed
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = until max_model_len
    min_tokens: int = 0  # eos / stop_token_ids cannot end the output before this many tokens
    logprobs: int | None = None  # top logprobs per sampled token, 0..MAX_LOGPROBS
    prompt_logprobs: int | None = None  # top logprobs per prompt token, 0..MAX_LOGPROBS
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True

    def __post_init__(self) -> None:
        # Normalise first, then validate. Frozen, so normalising goes through `_set`.
        set_ = self._set

        for name in ("n", "top_k", "min_tokens", "best_of", "seed", "max_tokens"):
            value = getattr(self, name)
            _check_int(name, value, allow_none=name in ("best_of", "seed", "max_tokens"))
            if value is not None:
                set_(name, int(value))  # numpy integers become plain ints
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            _check_float(name, getattr(self, name))
            set_(name, float(getattr(self, name)))
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "detokenize"):
            _check_flag(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:  # vLLM reads logprobs=True as "one"
                set_(name, 1)
            elif value is False:
                set_(name, None)
            else:
                _check_int(name, value, allow_none=True)
                if value is not None:
                    set_(name, int(value))

        if self.seed == -1:
            set_("seed", None)
        if self.top_k == -1:
            set_("top_k", 0)
        set_("stop", self._normalise_stop(self.stop))
        set_("stop_token_ids", self._normalise_stop_token_ids(self.stop_token_ids))

        self._verify_args()

        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change an argmax, so make them neutral and
            # let the sampler skip its sort.
            set_("top_p", 1.0)
            set_("top_k", 0)
            set_("min_p", 0.0)
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling (temperature=0), got {self.n}.")
        elif self.temperature < MIN_POSITIVE_TEMPERATURE:
            logger.warning("temperature %s is below %s, which overflows float32 logits; using %s.",
                           self.temperature, MIN_POSITIVE_TEMPERATURE, MIN_POSITIVE_TEMPERATURE)
            set_("temperature", MIN_POSITIVE_TEMPERATURE)

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}.")
        if any(not s for s in stop):
            raise ValueError("stop cannot contain an empty string.")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}.")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
                raise ValueError(f"stop_token_ids must contain only non-negative integers, got {list(ids)}.")
        return list(dict.fromkeys(int(t) for t in ids))

    def _verify_args(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported: it must be unset or equal to n={self.n}, "
                             f"got {self.best_of}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")

    # -- derived views ---------------------------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @functools.cached_property
    def uses_penalties(self) -> bool:
        """Whether the sampler needs this request's token history (the slower variant)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back from streamed text so a stop string never leaks partially."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    @functools.cached_property
    def sampler_row(self) -> tuple[float, float, float, float, float, float, float]:
        """The values the on-device sampler reads, in its column order: temperature (0 when
        greedy), top_p, top_k, min_p, presence, frequency and repetition penalty. Cached (the
        params are frozen) because the engine reads it for every running request every step."""
        temperature = 0.0 if self.is_greedy else self.temperature
        return (temperature, self.top_p, float(min(self.top_k, 1 << 24)), self.min_p,
                self.presence_penalty, self.frequency_penalty, self.repetition_penalty)

    @functools.cached_property
    def sampler_row_f32(self) -> bytes:
        """`sampler_row` packed as float32 bytes: joining these is the fastest way to build the
        sampler's per-row columns on the host."""
        return np.asarray(self.sampler_row, np.float32).tobytes()

    def clone(self) -> SamplingParams:
        """A deep copy (the stop lists are not shared)."""
        return copy.deepcopy(self)


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search settings, with vLLM's field names and defaults (`LLM.beam_search`).

    Each step extends every live beam by its `2 * beam_width` most likely next tokens and keeps the
    `beam_width` best candidates by summed logprob; the results are sorted by
    `cum_logprob / num_generated_tokens ** length_penalty` (see `jaxengine/beam_search.py`)."""

    beam_width: int  # beams kept per prompt, and sequences returned per prompt
    max_tokens: int  # tokens generated per beam at most
    ignore_eos: bool = False  # True: EOS does not end a beam (every beam runs max_tokens)
    temperature: float = 0.0  # of each step's sampled token; the candidates are the raw top logprobs
    length_penalty: float = 1.0  # exponent of the generated length that divides the final score
    include_stop_str_in_output: bool = False  # keep the EOS token's text in `output_text`

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            _check_int(name, getattr(self, name))
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "length_penalty"):
            _check_float(name, getattr(self, name))
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _check_flag(name, getattr(self, name))
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if 2 * self.beam_width > MAX_LOGPROBS:
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // 2}: each step asks for "
                             f"2 * beam_width top logprobs, and at most {MAX_LOGPROBS} are computed; "
                             f"got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
