"""Structured-output constraints of one request, with vLLM's names.

`SamplingParams(structured_outputs=StructuredOutputsParams(json=...))` constrains a request's
output to a JSON schema, a regular expression, one of a list of strings or a context-free
grammar (EBNF / GBNF or Lark). vLLM's older `GuidedDecodingParams` (`guided_decoding=`) is the
same thing under its former name. Exactly one constraint per request.

This module is pure data and validation of the request's shape; compiling the constraint into a
grammar, and checking that the schema, regex or grammar itself is valid, is the grammar
backend's job (`jaxengine/grammar.py`), done when the request is added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

# The constraint kinds, in the order vLLM lists them; exactly one is set per request.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint (vLLM's `StructuredOutputsParams`).

    json: a JSON schema (dict or JSON text): the output is a JSON value valid under it.
    regex: the output fully matches this regular expression.
    choice: the output is exactly one of these strings.
    grammar: an EBNF / GBNF or Lark grammar; the output is a sentence of it.
    json_object: True: the output is any JSON object.
    whitespace_pattern: for `json` / `json_object`, a regex for the whitespace allowed between
        JSON tokens (default: none, compact JSON; models run away on free whitespace).
    disable_any_whitespace: accepted for vLLM compatibility; JSON is compact unless
        `whitespace_pattern` says otherwise.
    disable_additional_properties: for `json`, objects without `additionalProperties` admit no
        keys beyond `properties`.
    disable_fallback: accepted for vLLM compatibility (there is one grammar backend).
    structural_tag: not supported (refused by name).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = f"{len(given)} are specified ({', '.join(given)})" if given else "none is specified"
            raise ValueError("structured_outputs: exactly one constraint of json, regex, choice, grammar or "
                             f"json_object must be given, but {what}.")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported; use json, regex, choice or grammar.")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(schema).__name__}.")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {type(self.regex).__name__}.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean.")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string.")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (the backend caches by it): the constraint's
        kind, its text and the options that change the grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        elif self.kind == "choice":
            value = json.dumps(value)
        return (self.kind, value, self.whitespace_pattern, self.disable_additional_properties)

    @classmethod
    def from_dict(cls, data: dict) -> StructuredOutputsParams:
        """From a request body's `structured_outputs` object (unknown keys are a ValueError)."""
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(data).__name__}.")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names - {"backend"})
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}.")
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's former name for `StructuredOutputsParams` (`SamplingParams(guided_decoding=...)`);
    `backend` is accepted and ignored (there is one grammar backend)."""

    backend: str | None = None
