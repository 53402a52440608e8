"""Tool calling and reasoning on chat completions, as vLLM serves them.

`plan_tools` reads `tools` / `tool_choice` / `parallel_tool_calls`:

- "none" (or no tools): free text; the tools still reach the chat template.
- "required": the output is constrained to a JSON array of `{"name": <a tool>, "parameters":
  <its schema>}` objects (one `anyOf` branch per tool; at most one item when
  `parallel_tool_calls` is false); the calls are read from that array.
- a named function: the output is constrained to that function's parameters schema and is the
  one call's arguments.
- "auto" (the default when tools are given; needs `--enable-auto-tool-choice`): free text, split
  into content and calls by the `--tool-call-parser` (server/tool_parsers.py); with
  `parallel_tool_calls: false` only the first call is kept.

`OutputParser` turns one choice's text into reasoning, content and tool-call pieces, whether fed
at once (the whole response) or piece by piece (a stream); both give the same result, so a
stream's deltas concatenate to the non-streamed message.
"""

from __future__ import annotations

import dataclasses
import logging

from jaxengine.server.errors import OpenAIError
from jaxengine.server.json_calls import CallPiece, CallScanner
from jaxengine.server.protocol import (AssistantMessage, ChatCompletionRequest, DeltaFunctionCall, DeltaToolCall,
                                       FunctionCall, NamedToolChoice, TokenizeChatRequest, ToolCall)
from jaxengine.server.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from jaxengine.server.structured_request import Constraint, constraint, request_constraint
from jaxengine.server.tool_parsers import TOOL_PARSERS, ToolParser, tool_parser_for_template

logger = logging.getLogger(__name__)

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclasses.dataclass(frozen=True)
class ToolSettings:
    """The server's tool-calling and reasoning flags."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a TOOL_PARSERS name
    reasoning_parser: str | None = None  # a REASONING_PARSERS name

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}; choose one of "
                             f"{', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose one of "
                             f"{', '.join(REASONING_PARSERS)}")

    def resolved(self, chat_template: str | None) -> ToolSettings:
        """With `--enable-auto-tool-choice` but no parser: the parser the chat template's tool
        format calls for (logged), or a ValueError that says to pick one."""
        if not self.enable_auto_tool_choice or self.tool_call_parser is not None:
            return self
        name = tool_parser_for_template(chat_template or "")
        if name is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: the chat template shows no tool-call "
                             f"format this server recognises; choose one of {', '.join(TOOL_PARSERS)}")
        logger.info("tool call parser %r chosen from the chat template", name)
        return dataclasses.replace(self, tool_call_parser=name)


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    choice: str  # none, auto, required, named
    function: str | None = None  # the named function
    constraint: Constraint | None = None  # required / named: the output's schema
    parser: type[ToolParser] | None = None  # auto: the text's tool-call format
    id_style: type[ToolParser] = ToolParser  # whose call ids (Mistral's templates want their own)
    single: bool = False  # parallel_tool_calls is false: one call at most


def plan_tools(settings: ToolSettings, req: ChatCompletionRequest) -> ToolPlan:
    """How `req`'s tools shape generation and the response; a 400 naming the field for bad input."""
    choice = req.tool_choice
    tools = req.tools or []
    id_kind = TOOL_PARSERS[settings.tool_call_parser] if settings.tool_call_parser else ToolParser
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and req.tools is None:
        raise OpenAIError("When using `tool_choice`, `tools` must be set.", 400, param="tool_choice")
    if choice == "required" and not tools:
        choice = "none"  # OpenAI's behaviour for an empty tool list
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise OpenAIError(AUTO_NEEDS_FLAGS, 400, param="tool_choice")
        return ToolPlan("auto", parser=TOOL_PARSERS[settings.tool_call_parser], id_style=id_kind,
                        single=req.parallel_tool_calls is False)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise OpenAIError(f"The tool specified in `tool_choice` ({name!r}) does not match any of the specified "
                              "`tools`.", 400, param="tool_choice")
        schema = tool.function.parameters or {"type": "object", "properties": {}}
        return ToolPlan("named", function=name, constraint=constraint("tools", {"json": schema}), id_style=id_kind)
    schema = required_schema(req)
    return ToolPlan("required", constraint=constraint("tools", {"json": schema}), id_style=id_kind)


def chat_constraint(req: ChatCompletionRequest, plan: ToolPlan) -> Constraint | None:
    """The output constraint of a chat request: its structured-output fields' or its tool
    choice's (both at once is a 400, as in vLLM)."""
    own = request_constraint(req)
    if own is not None and plan.constraint is not None:
        raise OpenAIError(f"You can only either use structured outputs or tools, not both: {own.param} and "
                          f"tool_choice {plan.choice!r} both constrain the output.", 400, param=own.param)
    return own or plan.constraint


def required_schema(req: ChatCompletionRequest) -> dict[str, object]:
    """The JSON schema of `tool_choice: "required"` output: an array of calls to the tools."""
    branches = []
    defs: dict[str, dict[str, object]] = {}  # "$defs" / "definitions" -> shared definitions
    for tool in req.tools or []:
        fn = tool.function
        # No other keys: a small model would otherwise run on with made-up ones.
        branch: dict[str, object] = {"type": "object",
                                     "properties": {"name": {"type": "string", "enum": [fn.name]}},
                                     "required": ["name"], "additionalProperties": False}
        if fn.parameters:
            params = dict(fn.parameters)
            for key in ("$defs", "definitions"):  # "#/$defs/..." references resolve from the root
                if key in params:
                    defs.setdefault(key, {}).update(params.pop(key) or {})
            branch["properties"]["parameters"] = params  # type: ignore[index]
            branch["required"] = ["name", "parameters"]
        branches.append(branch)
    schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def template_tools(req: ChatCompletionRequest | TokenizeChatRequest) -> list[dict[str, object]] | None:
    """The tools as the chat template gets them (OpenAI's `{"type": "function", "function": ...}`)."""
    if not req.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


@dataclasses.dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class OutputParser:
    """One choice's text -> reasoning, content and tool-call pieces (see the module docstring)."""

    def __init__(self, plan: ToolPlan, reasoning: type[ReasoningParser] | None, prompt: str):
        self.plan = plan
        self._reasoning = reasoning(prompt) if reasoning is not None else None
        self._tools = plan.parser() if plan.parser is not None else None
        self._scanner = CallScanner(("parameters",)) if plan.choice == "required" else None
        self._named_started = False
        self._ids: dict[int, str] = {}
        self.reasoned = False
        self.tools_called = plan.choice in ("required", "named")

    @property
    def has_reasoning(self) -> bool:
        return self._reasoning is not None

    def feed(self, text: str) -> OutputDelta:
        return self._step(text, last=False)

    def finish(self) -> OutputDelta:
        """The held-back rest; call once, after the last `feed`."""
        return self._step("", last=True)

    def _step(self, text: str, last: bool) -> OutputDelta:
        out = OutputDelta()
        if self._reasoning is not None:
            r = self._reasoning.finish() if last else self._reasoning.feed(text)
            out.reasoning, text = r.reasoning, r.content
            self.reasoned = self._reasoning.reasoned
        if self.plan.choice == "named":
            if text or (last and not self._named_started):  # an empty output is a call with no arguments
                piece = CallPiece(0, None if self._named_started else self.plan.function, text,
                                  not self._named_started)
                self._named_started = True
                out.tool_calls = self._deltas([piece])
        elif self._scanner is not None:
            self._scanner.feed(text)
            if last:
                self._scanner.close()
            out.tool_calls = self._deltas(self._scanner.take())
        elif self._tools is not None:
            d = self._tools.feed(text)
            if last:  # the reasoning parser's held-back rest first, then the tool parser's
                rest = self._tools.finish()
                d.content, d.calls = d.content + rest.content, d.calls + rest.calls
            out.content, out.tool_calls = d.content, self._deltas(d.calls)
            self.tools_called = self.tools_called or bool(self._ids)
        else:
            out.content = text
        return out

    def _deltas(self, pieces: list[CallPiece]) -> list[DeltaToolCall]:
        out = []
        for p in pieces:
            if self.plan.single and p.index > 0:
                continue
            if p.first:
                self._ids[p.index] = self.plan.id_style.call_id()
                out.append(DeltaToolCall(index=p.index, id=self._ids[p.index], type="function",
                                         function=DeltaFunctionCall(name=p.name, arguments=p.args)))
            elif p.args:
                out.append(DeltaToolCall(index=p.index, function=DeltaFunctionCall(arguments=p.args)))
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """vLLM's rule: "tool_calls" when the parser found calls (auto), or a required call list
        ended normally; a named function keeps the engine's reason."""
        if self.plan.choice == "auto" and self.tools_called and engine_reason is not None:
            return "tool_calls"
        if self.plan.choice == "required" and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def whole_message(parser: OutputParser, text: str) -> AssistantMessage:
    """The non-streamed message of one choice: the same pieces a stream would send, joined."""
    pieces = [parser.feed(text), parser.finish()]
    reasoning = "".join(p.reasoning for p in pieces)
    content = "".join(p.content for p in pieces)
    calls: dict[int, ToolCall] = {}
    for p in pieces:
        for d in p.tool_calls:
            if d.id is not None:
                calls[d.index] = ToolCall(id=d.id, function=FunctionCall(name=d.function.name or "", arguments=""))
            calls[d.index].function.arguments += (d.function.arguments or "") if d.function else ""
    tool_calls = [calls[i] for i in sorted(calls)]
    plain = not parser.has_reasoning and parser.plan.choice in ("none", "auto") and not tool_calls
    return AssistantMessage(content=content if plain else (content or None), tool_calls=tool_calls,
                            reasoning_content=reasoning if parser.reasoned else None)
