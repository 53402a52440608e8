"""The grammar backend of structured outputs: constraints compiled by llguidance, token bitmasks.

A request's `StructuredOutputsParams` (jaxengine/structured_outputs.py) becomes an llguidance
grammar (JSON schema, regex, choice, Lark / EBNF), checked and compiled once per distinct
constraint: `compile` keeps a fresh matcher per constraint key and each request gets a cheap
`deep_copy` of it. Compiling happens where the request is added (the server adds from its
request handlers, off the engine's step loop), so an invalid schema, regex or grammar is a
`ValueError` there, naming the field.

Each step, the engine asks for the next-token bitmask of every constrained row:
`[rows, ceil(V / 32)]` int32, bit `t % 32` of word `t // 32` set when token t is allowed; rows
without a constraint allow everything. The sampler applies it on the device
(`jaxengine.sampler.apply_bitmask`). After a step resolves, each constrained request's matcher
consumes its sampled token; a token the grammar rejects (a matcher error) fails that request
alone.

JSON is compact by default (no whitespace between tokens): with free whitespace small models
run away on spaces and newlines. `whitespace_pattern` sets the allowed whitespace instead.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from jaxengine.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped first)


def _grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of one constraint; ValueError names the field."""
    import llguidance

    kind = so.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else so.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        if isinstance(schema, dict) and so.disable_additional_properties:
            schema = _no_additional_properties(schema)
        options: dict[str, object] = {"whitespace_flexible": False}
        if so.whitespace_pattern is not None:
            options = {"whitespace_pattern": so.whitespace_pattern}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    try:  # grammar: Lark, or GBNF / EBNF converted to Lark
        return llguidance.grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


def _no_additional_properties(schema: dict) -> dict:
    """The schema with `additionalProperties: false` on every object that does not say."""
    def walk(node):
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
                out["additionalProperties"] = False
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    return walk(schema)


class GrammarBackend:
    """Compiles constraints for one tokenizer and computes the rows' bitmasks. Thread-safe:
    `compile` runs in request handlers while the engine thread steps."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        """`tokenizer`: the model's transformers (fast) tokenizer; `vocab_size`: the model's
        logits width (the bitmask covers it); `eos_token_ids`: the model's, allowed where the
        grammar may end."""
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.num_words = -(-vocab_size // 32)  # bitmask width the sampler reads
        self._ll_tokenizer = None
        self._executor = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, object] = OrderedDict()

    @property
    def ll_tokenizer(self):
        """llguidance's view of the tokenizer, built on first use (about a second)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                n_vocab = max(self.vocab_size, len(self.tokenizer))
                eos = self.eos_token_ids or None
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab, eos_token=eos)
            return self._ll_tokenizer

    def compile(self, so: StructuredOutputsParams):
        """A fresh matcher for `so` (cached by its key); ValueError for an invalid constraint."""
        import llguidance

        key = so.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        text = _grammar_text(so)
        tok = self.ll_tokenizer
        matcher = llguidance.LLMatcher(tok, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{so.kind}: {matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, so: StructuredOutputsParams):
        """A request's own matcher for `so` at its start state."""
        return self.compile(so).deep_copy()

    def fill_bitmask(self, rows: Sequence[tuple[object, int]], num_rows: int) -> np.ndarray:
        """[num_rows, num_words] int32: row i allows every token, except rows given as
        (matcher, i), which allow what their matcher allows next. A matcher in an error state
        or stopped allows everything (its request is over; the row's token is dropped)."""
        import llguidance
        import llguidance.numpy as llnp

        width = -(-self.ll_tokenizer.vocab_size // 32)
        mask = np.full((num_rows, width), -1, np.int32)
        live = [(m, i) for m, i in rows if not m.is_error() and not m.is_stopped()]
        if live:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llnp.fill_next_token_bitmask_par(self._executor, live, mask)
        if width > self.num_words:
            mask = np.ascontiguousarray(mask[:, : self.num_words])
        elif width < self.num_words:  # tokens the tokenizer does not have: never allowed
            mask = np.concatenate([mask, np.zeros((num_rows, self.num_words - width), np.int32)], axis=1)
        return mask


def allowed_tokens(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows (tests and debugging)."""
    bits = (mask_row[:, None].astype(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:vocab_size])
