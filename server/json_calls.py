"""Function calls read out of JSON text as it streams in, one character at a time.

A *call object* is a JSON object at the top level, or an item of a top-level array:
`{"name": "f", "arguments": {...}}`, `[{"name": "f", "parameters": {...}}, ...]`, or several
objects one after another (separated by `;`, `,` or whitespace). Of each call object the scanner
keeps the `name` (once its string is complete) and the *raw text* of its arguments value (the
first of `args_keys` present), exactly as generated. Arguments are kept raw rather than re-dumped
so that a streamed call, whose arguments go out piece by piece as they arrive, concatenates to
exactly the text the non-streamed response reports. A call object without an arguments key gets
`{}` when it closes.

The scanner is a small state machine over JSON's structure (strings with escapes, nesting); it
does not validate. Feeding a text in any split gives the same calls (`tests/server/test_tool_parsers.py`).
"""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass
class ScannedCall:
    name: str | None = None  # None until the name string is complete
    args: str = ""  # raw arguments text so far
    has_args: bool = False
    done: bool = False  # the call object is closed


@dataclasses.dataclass
class CallPiece:
    """What a call adds since the last `take`: its name the first time (with `first` set), then
    arguments text."""

    index: int  # the call's position among named calls
    name: str | None
    args: str
    first: bool


class CallScanner:
    def __init__(self, args_keys: tuple[str, ...] = ("arguments", "parameters")):
        self.args_keys = args_keys
        self.calls: list[ScannedCall] = []
        self._stack: list[str] = []  # open containers, "{" or "["
        self._depth = 0  # stack depth of the call object being read; 0 outside calls
        self._state = ""  # inside a call object: key, colon, value, in_value, scalar, after
        self._key = ""
        self._buf = ""  # raw text of a key or name string being read
        self._string: str | None = None  # what the open string is: key, name, value, nested, outer
        self._escape = False
        self._capture = False  # the value being read is the arguments
        self._sent: list[tuple[int, int]] = []  # per call: (index given or -1, args characters sent)
        self._named = 0

    # -- feeding --------------------------------------------------------------------------------
    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def close(self) -> None:
        """Ends the current structure (a call cut short stays as far as it got)."""
        if self._depth:
            self._close_call()
        self._stack.clear()
        self._string, self._escape, self._state = None, False, ""

    def _char(self, ch: str) -> None:
        if self._string is not None:
            self._string_char(ch)
            return
        if self._depth and len(self._stack) > self._depth:  # nested inside a call's value
            if self._capture:
                self.calls[-1].args += ch
            if ch == '"':
                self._string = "nested"
            elif ch in "{[":
                self._stack.append(ch)
            elif ch in "}]":
                self._stack.pop()
                if len(self._stack) == self._depth:
                    self._value_done()
            return
        if self._depth:
            self._call_char(ch)
            return
        if ch == "{" and (not self._stack or self._stack == ["["]):
            self._stack.append(ch)
            self._depth = len(self._stack)
            self.calls.append(ScannedCall())
            self._state = "key"
        elif ch in "{[":
            self._stack.append(ch)
        elif ch in "}]" and self._stack:
            self._stack.pop()
        elif ch == '"':
            self._string = "outer"

    def _string_char(self, ch: str) -> None:
        kind = self._string
        if self._capture:
            self.calls[-1].args += ch
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._string = None
            if kind == "key":
                self._key = _unquote(self._buf)
                self._state = "colon"
            elif kind == "name":
                self.calls[-1].name = _unquote(self._buf)
                self._value_done()
            elif kind == "value":
                self._value_done()
            return
        if kind in ("key", "name"):
            self._buf += ch

    def _call_char(self, ch: str) -> None:
        """A character directly inside a call object (not inside one of its values)."""
        call = self.calls[-1]
        state = self._state
        if state == "scalar":
            if ch.isspace() or ch in ",}":
                self._value_done()
                state = self._state
            else:
                if self._capture:
                    call.args += ch
                return
        if ch.isspace():
            return
        if state == "key":
            if ch == '"':
                self._string, self._buf = "key", ""
            elif ch == "}":
                self._close_call()
        elif state == "colon":
            if ch == ":":
                self._state = "value"
        elif state == "value":
            self._capture = self._key in self.args_keys and not call.has_args
            if self._capture:
                call.has_args = True
                call.args += ch
            if ch == '"':
                self._string, self._buf = ("name" if self._key == "name" else "value"), ""
                self._state = "in_value"
            elif ch in "{[":
                self._stack.append(ch)
                self._state = "in_value"
            else:
                self._state = "scalar"
        elif state == "after":
            if ch == ",":
                self._state = "key"
            elif ch == "}":
                self._close_call()

    def _value_done(self) -> None:
        self._capture = False
        self._state = "after"

    def _close_call(self) -> None:
        call = self.calls[-1]
        if not call.has_args:
            call.args, call.has_args = "{}", True
        call.done = True
        del self._stack[self._depth - 1:]
        self._depth, self._state, self._capture = 0, "", False

    # -- reading --------------------------------------------------------------------------------
    def take(self) -> list[CallPiece]:
        """What is new since the last call: a call's name once known, then its arguments text
        as it grows. Calls are numbered in the order their names complete."""
        pieces = []
        while len(self._sent) < len(self.calls):
            self._sent.append((-1, 0))
        for i, call in enumerate(self.calls):
            index, sent = self._sent[i]
            if call.name is None:
                continue
            first = index < 0
            if first:
                index, self._named = self._named, self._named + 1
            if first or len(call.args) > sent:
                pieces.append(CallPiece(index, call.name if first else None, call.args[sent:], first))
                self._sent[i] = (index, len(call.args))
        return pieces


def _unquote(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw
