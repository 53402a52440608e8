"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser`), with vLLM's names.

Each parser reads the model's free text (after reasoning, if a reasoning parser runs) and splits
it into content and function calls:

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call; content is what comes before the first block.
- `llama3_json` (Llama 3.1 / 3.2): `{"name": ..., "parameters": {...}}` as the whole output,
  optionally after `<|python_tag|>`, several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

A parser is fed the text as it streams (`feed`, then `finish`) and hands back content pieces and
`CallPiece`s; `extract` feeds a whole text at once, so the streamed pieces of a text always
concatenate to what `extract` returns for it. Tags split across pieces are held back until they
are complete. Arguments are the raw JSON text the model wrote (server/json_calls.py).
"""

from __future__ import annotations

import dataclasses
import random
import re
import string
import uuid
from typing import ClassVar

from jaxengine.server.json_calls import CallPiece, CallScanner
from jaxengine.server.reasoning_parsers import partial_suffix


@dataclasses.dataclass
class ToolDelta:
    content: str = ""
    calls: list[CallPiece] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ExtractedToolCalls:
    content: str | None  # None when there is none (or only whitespace around calls)
    calls: list[tuple[str, str]]  # (name, arguments JSON text)


class ToolParser:
    """Base: content until `start_tag`, then calls read by a `CallScanner` (to the end, or to
    `end_tag` for each block when the format closes its blocks)."""

    name: ClassVar[str]
    start_tag: ClassVar[str]
    end_tag: ClassVar[str | None] = None
    args_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    special_tokens_in_text: ClassVar[bool] = True  # the tags are special tokens: keep them in the text

    def __init__(self) -> None:
        self._scanner = CallScanner(self.args_keys)
        self._pending = ""  # text not yet handed out (a tag may start in it)
        self._mode = "content"  # content, calls (inside a block), between (after a closed block)
        self._content_sent = False  # whitespace alone before any content waits: calls may follow
        self.tools_called = False

    @staticmethod
    def call_id() -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    # -- streaming ------------------------------------------------------------------------------
    def feed(self, text: str) -> ToolDelta:
        self._pending += text
        out = ToolDelta()
        while True:
            before = (self._mode, len(self._pending))
            if self._mode == "content":
                self._content_step(out)
            elif self._mode == "calls":
                self._calls_step()
            else:
                self._between_step()
            if (self._mode, len(self._pending)) == before:
                break
        out.calls = self._scanner.take()
        return out

    def finish(self) -> ToolDelta:
        """Hands out whatever was held back; call once, after the last `feed`."""
        out = ToolDelta()
        if self._mode == "content":
            out.content = self._pending
        elif self._mode == "calls":
            self._scanner.feed(self._pending)
        self._pending = ""
        self._scanner.close()
        out.calls = self._scanner.take()
        return out

    def _content_step(self, out: ToolDelta) -> None:
        at = self._find_start()
        if at >= 0:
            self.tools_called = True
            content, self._pending = self._pending[:at], self._pending[at:]
            self._emit(out, content)
            self._pending = self._pending[len(self.start_tag):] if self._pending.startswith(self.start_tag) \
                else self._pending
            self._mode = "calls"
            return
        keep = partial_suffix(self._pending, self.start_tag)
        ready = self._pending[:len(self._pending) - keep]
        if self._emit(out, ready):
            self._pending = self._pending[len(ready):]

    def _emit(self, out: ToolDelta, content: str) -> bool:
        """Hands out `content` unless it is whitespace before any content (then it is dropped
        if calls follow, and handed out by `finish` if not)."""
        if not (self._content_sent or content.strip()):
            return False
        out.content += content
        self._content_sent = True
        return True

    def _find_start(self) -> int:
        return self._pending.find(self.start_tag)

    def _calls_step(self) -> None:
        if self.end_tag is None:
            self._scanner.feed(self._pending)
            self._pending = ""
            return
        at = self._pending.find(self.end_tag)
        if at >= 0:
            self._scanner.feed(self._pending[:at])
            self._scanner.close()
            self._pending = self._pending[at + len(self.end_tag):]
            self._mode = "between"
            return
        keep = partial_suffix(self._pending, self.end_tag)
        self._scanner.feed(self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]

    def _between_step(self) -> None:
        """After a closed block: text up to the next block is dropped (as vLLM drops it)."""
        at = self._pending.find(self.start_tag)
        if at >= 0:
            self._pending = self._pending[at + len(self.start_tag):]
            self._mode = "calls"
        else:
            self._pending = self._pending[len(self._pending) - partial_suffix(self._pending, self.start_tag):]

    # -- whole text -----------------------------------------------------------------------------
    def extract(self, text: str) -> ExtractedToolCalls:
        """Content and calls of a whole output (a fresh parser each time)."""
        parser = type(self)()
        pieces = [parser.feed(text), parser.finish()]
        content = "".join(p.content for p in pieces)
        calls: dict[int, list[str]] = {}
        for p in pieces:
            for c in p.calls:
                entry = calls.setdefault(c.index, [c.name or "", ""])
                entry[1] += c.args
        return ExtractedToolCalls(content or None, [(n, a) for n, a in (calls[i] for i in sorted(calls))])


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    TOOL_PARSERS[cls.name] = cls
    return cls


@register
class HermesToolParser(ToolParser):
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    args_keys = ("arguments",)


@register
class MistralToolParser(ToolParser):
    name = "mistral"
    start_tag = "[TOOL_CALLS]"
    args_keys = ("arguments",)

    @staticmethod
    def call_id() -> str:
        """Mistral's templates want 9 alphanumeric characters."""
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@register
class Llama3JsonToolParser(ToolParser):
    """Calls after `<|python_tag|>`, or an output that starts (after whitespace) with `{`."""

    name = "llama3_json"
    start_tag = "<|python_tag|>"
    args_keys = ("parameters", "arguments")
    special_tokens_in_text = False  # calls are recognised without the tag too

    def __init__(self) -> None:
        super().__init__()
        self._started = False  # a non-whitespace character has been seen

    def _find_start(self) -> int:
        if not self._started and self._pending.strip():
            self._started = True
            stripped = self._pending.lstrip()
            if stripped.startswith("{"):
                self.tools_called = True
                self._pending = stripped
                self._mode = "calls"
                return -1
        return self._pending.find(self.start_tag)

    def _content_step(self, out: ToolDelta) -> None:
        self._find_start()
        if self._mode == "content" and self._started:
            super()._content_step(out)


def tool_parser_for_template(template: str) -> str | None:
    """The parser a chat template's tool format calls for, or None if it shows none."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or re.search(r'parameters\\?"\s*:\s*dictionary', template):
        return "llama3_json"
    return None
