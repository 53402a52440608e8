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

from jaxengine.structured_outputs import StructuredOutputsParams

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
# Widths of the sampler's per-row logit edits (compile-time constants of the sampler variant that
# reads them): logit_bias entries, allowed_token_ids, bad words (token sequences after both
# spellings, with and without a leading space) and tokens per bad word.
MAX_LOGIT_BIAS = 300
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BAD_WORDS = 32
MAX_BAD_WORD_TOKENS = 8


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
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, before sampling
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words never generated (their last token is banned after the rest)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len - 1)
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar to follow
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's former name for structured_outputs

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
        set_("logit_bias", self._normalise_logit_bias(self.logit_bias))
        set_("allowed_token_ids", self._normalise_allowed(self.allowed_token_ids))
        set_("bad_words", self._normalise_bad_words(self.bad_words))
        set_("structured_outputs", self._normalise_structured(self.structured_outputs, self.guided_decoding))
        set_("guided_decoding", None)
        _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, allow_none=True)
        if self.truncate_prompt_tokens is not None:
            set_("truncate_prompt_tokens", int(self.truncate_prompt_tokens))

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

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}.")
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:  # JSON object keys arrive as strings
                tid = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}.") from None
            if isinstance(key, (bool, float)) or tid < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}.")
            _check_float(f"logit_bias[{key!r}]", value)
            out[tid] = out.get(tid, 0.0) + float(value)
        if len(out) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(out)}.")
        return out or None

    @staticmethod
    def _normalise_allowed(ids: object) -> list[int] | None:
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in ids):
            raise ValueError(f"allowed_token_ids must be a list of non-negative token ids, got {ids!r}.")
        if not ids:
            raise ValueError("allowed_token_ids must not be empty: nothing could be sampled.")
        out = list(dict.fromkeys(int(t) for t in ids))
        if len(out) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids may hold at most {MAX_ALLOWED_TOKEN_IDS} tokens, got {len(out)}.")
        return out

    @staticmethod
    def _normalise_structured(so: object, guided: object) -> StructuredOutputsParams | None:
        """One constraint object from `structured_outputs` or its alias `guided_decoding` (a
        StructuredOutputsParams, or a dict of its fields)."""
        if so is not None and guided is not None:
            raise ValueError("give structured_outputs or guided_decoding (its former name), not both.")
        so = so if so is not None else guided
        if so is None or isinstance(so, StructuredOutputsParams):
            return so
        if isinstance(so, dict):
            return StructuredOutputsParams.from_dict(so)
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}.")

    @staticmethod
    def _normalise_bad_words(words: object) -> list[str] | None:
        if words is None:
            return None
        if isinstance(words, str):
            words = [words]
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise ValueError(f"bad_words must be a list of strings, got {words!r}.")
        if any(not w.strip() for w in words):
            raise ValueError("bad_words cannot contain an empty string.")
        return list(words) or None

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
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):
            raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len - 1) or at least 1, "
                             f"got {self.truncate_prompt_tokens}.")

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

    @functools.cached_property
    def truncates(self) -> bool:
        """Whether sampling keeps only the top-k / top-p tokens (the sampler's sort)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)

    @functools.cached_property
    def uses_logit_edits(self) -> bool:
        """Whether the sampler edits this request's logits: logit_bias, allowed_token_ids or
        bad_words (read by the same sampler variant as penalties)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The bad words as token sequences (`update_from_tokenizer`); [] before that."""
        return self.__dict__.get("_bad_words_token_ids", [])

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenizes the bad words, as vLLM does: each word as written (leading spaces
        stripped) and, where it tokenizes differently and to as many tokens, with one leading
        space (the form it takes mid-sentence). Idempotent."""
        if not self.bad_words or "_bad_words_token_ids" in self.__dict__:
            return
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none")
        seqs: list[list[int]] = []
        for word in self.bad_words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            for ids in (plain, spaced if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else None):
                if ids and ids not in seqs:
                    if len(ids) > MAX_BAD_WORD_TOKENS:
                        raise ValueError(f"bad word {word!r} is {len(ids)} tokens long; at most "
                                         f"{MAX_BAD_WORD_TOKENS} are supported.")
                    seqs.append(ids)
        if len(seqs) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words tokenize to {len(seqs)} token sequences; at most {MAX_BAD_WORDS} "
                             "are supported.")
        self.__dict__["_bad_words_token_ids"] = seqs

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the request's output tokens so far: penalties, and bad words
        of several tokens (banned only after the tokens before their last)."""
        return self.uses_penalties or any(len(w) > 1 for w in self.bad_words_token_ids)

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


def lean_form(any_logprobs: bool, all_greedy: bool) -> str | None:
    """The sampler's lean form for a step's rows (jaxengine.sampler.sample's `lean`): None when a
    row asks for logprobs (the full sampler), "greedy" when every row is greedy, else "sample"."""
    if any_logprobs:
        return None
    return "greedy" if all_greedy else "sample"
