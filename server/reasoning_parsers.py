"""Reasoning parsers (`--reasoning-parser`), with vLLM's names: `<think>...</think>` goes to
`reasoning_content`, the rest to `content`.

- `deepseek_r1`: the output starts in reasoning, whether or not it repeats `<think>` (the chat
  template may have put it in the prompt); reasoning ends at `</think>`. Without `</think>`
  everything is reasoning.
- `qwen3`: reasoning only when the output opens with `<think>`, or the prompt left a `<think>`
  open (Qwen3 "Thinking" templates put it there); it ends at `</think>`. Otherwise (for example
  with `chat_template_kwargs: {"enable_thinking": false}`) everything is content, as in vLLM.

A parser is fed the output as it streams (`feed`, then `finish`); `extract` feeds a whole text,
so streamed pieces always concatenate to the non-streamed fields. Tags split across pieces are
held back until they are complete. Where vLLM's whole-text and streamed answers differ (an
output with `</think>` but no `<think>` on a qwen3 prompt that did not open one), this follows
the streamed one's rule of deciding at the start: such an output is content.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

START, END = "<think>", "</think>"


@dataclasses.dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    name: ClassVar[str]
    starts_in_reasoning: ClassVar[bool]  # without a leading <think> (and without one open in the prompt)

    def __init__(self, prompt: str = "") -> None:
        opened = prompt.rfind(START) > prompt.rfind(END)  # the prompt leaves a <think> open
        self._mode = "reasoning" if opened else "start"  # start: the first characters decide
        self._pending = ""
        self.reasoned = opened  # reasoning mode was entered

    def feed(self, text: str) -> ReasoningDelta:
        self._pending += text
        out = ReasoningDelta()
        if self._mode == "start":
            head = self._pending.lstrip()
            if START.startswith(head):  # empty, or a beginning of <think>: wait
                return out
            if head.startswith(START):
                self._pending = head[len(START):]
                self._mode = "reasoning"
            else:
                self._mode = "reasoning" if self.starts_in_reasoning else "content"
            self.reasoned = self._mode == "reasoning"
        if self._mode == "reasoning":
            at = self._pending.find(END)
            if at < 0:
                keep = partial_suffix(self._pending, END)
                out.reasoning, self._pending = self._pending[:len(self._pending) - keep], self._pending[
                    len(self._pending) - keep:]
                return out
            out.reasoning, self._pending = self._pending[:at], self._pending[at + len(END):]
            self._mode = "content"
        out.content, self._pending = self._pending, ""
        return out

    def finish(self) -> ReasoningDelta:
        """Hands out whatever was held back; call once, after the last `feed`."""
        out = ReasoningDelta()
        if self._mode == "start":  # only whitespace or a cut-short <think> came
            self._mode = "reasoning" if self.starts_in_reasoning else "content"
            self.reasoned = self.reasoned or self.starts_in_reasoning
        if self._mode == "reasoning":
            out.reasoning = self._pending
        else:
            out.content = self._pending
        self._pending = ""
        return out

    def extract(self, text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None where there is none."""
        parser = type(self)(prompt)
        a, b = parser.feed(text), parser.finish()
        reasoning, content = a.reasoning + b.reasoning, a.content + b.content
        return (reasoning if parser.reasoned else None), (content or None)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (held back: the
    tag may be completed by the next piece)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}
