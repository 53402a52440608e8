"""Incremental detokenization of one sequence, with stop strings and stream hold-back.

Tokens arrive one step at a time. Decoding all output ids every step is quadratic and
decoding each token alone is wrong (byte-level BPE splits a character's UTF-8 bytes across
tokens; SentencePiece decoders drop a word's leading space at the start of a decode). So each
sequence keeps a short window of ids: the text of `ids[prefix:]` minus the text of
`ids[prefix:read]` is what the new tokens add, emitted only once it no longer ends in an
incomplete character (U+FFFD), after which the window slides forward. With a Hugging Face fast
tokenizer the same algorithm runs in Rust (`tokenizers.decoders.DecodeStream`); other
tokenizers use the Python window below. Both start from the last few prompt tokens so the
first output token decodes in context (e.g. keeps its leading space).

Stop strings are searched only in the newly decoded tail plus `len(stop) - 1` characters
before it, so a stop spanning tokens is found and the cost per step stays constant.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from jaxengine.sampling_params import SamplingParams

try:  # the Rust fast path needs tokenizers >= 0.21 (DecodeStream)
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a dependency of transformers
    RustTokenizer = DecodeStream = None

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token.
PROMPT_CONTEXT_TOKENS = 5
# Farthest back into the prompt the context search goes to avoid starting mid-character.
MAX_PROMPT_CONTEXT_TOKENS = 24


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: object) -> str: ...

    def __len__(self) -> int: ...


def _backend(tokenizer: object) -> RustTokenizer | None:
    """The Rust `tokenizers.Tokenizer` behind a fast HF tokenizer, if there is one."""
    if DecodeStream is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, RustTokenizer) else None


def _prompt_context(decode_ids, prompt_ids: Sequence[int]) -> list[int]:
    """The last few prompt ids, extended back until their text does not start mid-character."""
    if len(prompt_ids) <= PROMPT_CONTEXT_TOKENS:
        return list(prompt_ids)
    for n in range(PROMPT_CONTEXT_TOKENS, min(len(prompt_ids), MAX_PROMPT_CONTEXT_TOKENS) + 1):
        ids = list(prompt_ids[-n:])
        if not decode_ids(ids).startswith(REPLACEMENT_CHAR):
            return ids
    return list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])


class _StreamDecoder:
    """Window decoding in Rust via `tokenizers.decoders.DecodeStream`.

    The fast path ignores `spaces_between_special_tokens`, as fast tokenizers' own `decode` does.
    """

    def __init__(self, backend: RustTokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool):
        self._backend = backend
        self._skip = skip_special_tokens
        self._vocab = backend.get_vocab_size(with_added_tokens=True)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        context = _prompt_context(lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens),
                                  [t for t in prompt_ids if 0 <= t < self._vocab])
        for t in context:
            self._step(t)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            return self._restart(token_id, e)

    def _restart(self, token_id: int, error: Exception) -> str | None:
        # A decoder can produce text that is not an extension of the previous text
        # ("Invalid prefix encountered"); restart the stream rather than fail the request.
        logger.warning("restarting the decode stream after %s", error)
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        return self._stream.step(self._backend, token_id)

    def decode_next(self, token_id: int) -> str:
        if not 0 <= token_id < self._vocab:  # padded-vocabulary ids have no text
            return ""
        try:  # `_step` inlined: this runs for every token
            return self._stream.step(self._backend, token_id) or ""
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            return self._restart(token_id, e) or ""


class _WindowDecoder:
    """The same window algorithm in Python, over any tokenizer with `decode`."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool):
        self._tokenizer = tokenizer
        self._kwargs = {"skip_special_tokens": skip_special_tokens,
                        "spaces_between_special_tokens": spaces_between_special_tokens,
                        "clean_up_tokenization_spaces": False}
        self._vocab = len(tokenizer)
        self._ids = _prompt_context(self._decode, [t for t in prompt_ids if 0 <= t < self._vocab])
        self._prefix = 0  # ids[prefix:read] is the already-emitted context
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._kwargs)

    def decode_next(self, token_id: int) -> str:
        if not 0 <= token_id < self._vocab:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        # Drop ids no window will read again, so the list stays short.
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        return full_text[len(prefix_text) :]


def find_stop(text: str, new_chars: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The earliest stop string ending in the last `new_chars` characters of `text`.

    Returns (stop string, start index) or None. Only the tail that could hold a new match is
    searched: `new_chars` plus `len(stop) - 1` characters.
    """
    if new_chars <= 0:
        return None
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[1]):
            best = (stop, i)
    return best


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text as they arrive, and watches stop strings.

    `output_text` is the text so far; once a stop string matched it is cut before the stop
    (or after it with `include_stop_str_in_output`) and the caller should finish the sequence.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams,
                 *, use_decode_stream: bool | None = None):
        """`use_decode_stream`: None picks the Rust path when the tokenizer has one."""
        backend = _backend(tokenizer) if use_decode_stream in (None, True) else None
        if use_decode_stream and backend is None:
            raise ValueError("use_decode_stream=True needs a fast (Rust-backed) tokenizer")
        self._decoder: _StreamDecoder | _WindowDecoder
        if backend is not None:
            self._decoder = _StreamDecoder(backend, prompt_token_ids, params.skip_special_tokens)
        else:
            self._decoder = _WindowDecoder(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                           params.spaces_between_special_tokens)
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = params.output_text_buffer_length
        self.output_text = ""
        self.num_output_tokens = 0
        self._emitted = 0  # characters of output_text already handed out as deltas

    def update(self, new_token_ids: Sequence[int], *, stop_terminated: bool = False) -> str | None:
        """Appends `new_token_ids`; returns the stop string they completed, if any.

        `stop_terminated`: the last id is an eos / stop token id that ended the sequence; its
        text is left out unless `include_stop_str_in_output` (vLLM's rule).
        """
        ids = list(new_token_ids)
        skip_last = stop_terminated and not self.include_stop_str_in_output and ids
        if skip_last:
            ids = ids[:-1]
        base = len(self.output_text)
        check_from = base  # stop strings may not end inside the first min_tokens tokens
        pieces = []
        for t in ids:
            self.num_output_tokens += 1
            piece = self._decoder.decode_next(int(t))
            pieces.append(piece)
            if self.num_output_tokens <= self.min_tokens:
                check_from += len(piece)
        if skip_last:
            self.num_output_tokens += 1
        self.output_text += "".join(pieces)
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        match = find_stop(self.output_text, len(self.output_text) - check_from, self.stop)
        if match is None:
            return None
        stop, start = match
        end = start + len(stop) if self.include_stop_str_in_output else start
        self.output_text = self.output_text[:end]
        return stop

    def update_one(self, token_id: int) -> str | None:
        """`update([token_id])` for the common case of one new token that did not end the
        sequence: the same text and the same stop-string match, without the list work."""
        self.num_output_tokens += 1
        piece = self._decoder.decode_next(token_id)
        if piece:
            self.output_text += piece
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        match = find_stop(self.output_text, len(piece), self.stop)
        if match is None:
            return None
        stop, start = match
        end = start + len(stop) if self.include_stop_str_in_output else start
        self.output_text = self.output_text[:end]
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for a streamed output: all of it, or (delta) only what was not handed out yet.

        While unfinished the last `len(longest stop) - 1` characters are held back, since they
        may be the start of a stop string that must not reach the client.
        """
        hold = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - hold, 0)
        if not delta:
            return self.output_text[:end]
        start = self._emitted
        if start >= end:
            return ""
        self._emitted = end
        return self.output_text[start:end]


def decode_token(tokenizer: Tokenizer, token_id: int) -> str:
    """The text of one token on its own (for `Logprob.decoded_token`); special tokens included."""
    if token_id < 0:
        return ""
    backend = _backend(tokenizer)
    if backend is not None:  # ids past the vocabulary decode to ""
        return backend.decode([int(token_id)], skip_special_tokens=False)
    if token_id >= len(tokenizer):
        return ""
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)


def decode_tokens(tokenizer: Tokenizer, token_ids: Sequence[int]) -> list[str]:
    """`decode_token` for many ids at once (one Rust call with a fast tokenizer)."""
    backend = _backend(tokenizer)
    if backend is not None:
        return backend.decode_batch([[int(t)] if t >= 0 else [] for t in token_ids], skip_special_tokens=False)
    return [decode_token(tokenizer, t) for t in token_ids]
