"""Tool-call and reasoning parsers on hand-written outputs: the whole text gives the expected
content, calls and reasoning, and the same text streamed in small random pieces concatenates to
exactly the same (tags split across pieces included)."""

from __future__ import annotations

import json
import random

import pytest

from jaxengine.server.json_calls import CallScanner
from jaxengine.server.reasoning_parsers import REASONING_PARSERS
from jaxengine.server.tool_parsers import TOOL_PARSERS, tool_parser_for_template

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"q": "a \\"quoted\\" } ] { [ text", "opts": {"n": [1, 2, {"x": null}]}, "ok": true}'

TOOL_CASES = [
    # (parser, output, content, calls)
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None,
     [("get_weather", WEATHER)]),
    ("hermes", f'Let me check.\n<tool_call>{{"name": "a", "arguments": {NESTED}}}</tool_call>\n'
               f'<tool_call>{{"arguments": {{}}, "name": "b"}}</tool_call>', "Let me check.\n",
     [("a", NESTED), ("b", "{}")]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.",
     []),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    ("hermes", '<tool_call>{"name": "cut", "arguments": {"a": 1', None, [("cut", '{"a": 1')]),  # max_tokens
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    ("llama3_json", f'<|python_tag|>{{"name": "a", "parameters": {NESTED}}}; {{"name": "b", "parameters": {{}}}}',
     None, [("a", NESTED), ("b", "{}")]),
    ("llama3_json", "  \n" + f'{{"name": "f", "arguments": {WEATHER}}}', None, [("f", WEATHER)]),
    ("llama3_json", 'The answer is {"not": "a call"}', 'The answer is {"not": "a call"}', []),
    ("llama3_json", "Sure.<|python_tag|>" + f'{{"name": "f", "parameters": {WEATHER}}}', "Sure.", [("f", WEATHER)]),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
                f'{{"name": "n", "arguments": {NESTED}}}]',
     None, [("get_weather", WEATHER), ("n", NESTED)]),
    ("mistral", f'Calling.[TOOL_CALLS][{{"name": "f", "arguments": {WEATHER}}}]', "Calling.", [("f", WEATHER)]),
    ("mistral", "Plain [TOOL text.", "Plain [TOOL text.", []),
]


def random_pieces(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(1, 4)
        pieces.append(text[i:i + k])
        i += k
    return pieces


def stream_tools(name: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    parser = TOOL_PARSERS[name]()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.calls:
            if c.first:
                assert c.index not in calls and c.name
                calls[c.index] = [c.name, ""]
            else:
                assert c.name is None
            calls[c.index][1] += c.args
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("name,text,content,calls", TOOL_CASES)
def test_tool_parser_whole_and_streamed(name, text, content, calls):
    got = TOOL_PARSERS[name]().extract(text)
    assert (got.content, got.calls) == (content, calls)
    for call_name, args in got.calls:
        if args.endswith("}"):
            json.loads(args)
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(20):
        assert stream_tools(name, random_pieces(text, rng)) == (content, calls)
    assert stream_tools(name, list(text)) == (content, calls)


def test_call_ids():
    hermes = TOOL_PARSERS["hermes"].call_id()
    assert hermes.startswith("chatcmpl-tool-") and len(hermes) == len("chatcmpl-tool-") + 32
    mistral = TOOL_PARSERS["mistral"].call_id()
    assert len(mistral) == 9 and mistral.isalnum()


def test_scanner_reads_the_required_array():
    """The `tool_choice: "required"` output: an array of {name, parameters}, in any split."""
    text = f'[{{"name":"a","parameters":{NESTED}}},{{"parameters":{WEATHER},"name":"b"}}]'
    for split in (1, 3, 7, len(text)):
        scanner = CallScanner(("parameters",))
        calls: dict[int, list[str]] = {}
        for i in range(0, len(text), split):
            scanner.feed(text[i:i + split])
            for p in scanner.take():
                calls.setdefault(p.index, [p.name, ""])[1] += p.args
        assert [tuple(calls[i]) for i in sorted(calls)] == [("a", NESTED), ("b", WEATHER)]


def test_parser_from_template():
    assert tool_parser_for_template("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert tool_parser_for_template("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert tool_parser_for_template('{{- "<|python_tag|>" + tool_call.name }}') == "llama3_json"
    assert tool_parser_for_template(
        'Respond in the format {\\"name\\": function name, \\"parameters\\": dictionary of argument name and its '
        'value}.') == "llama3_json"
    assert tool_parser_for_template("{{ messages }}") is None


REASONING_CASES = [
    # (parser, prompt, output, reasoning, content)
    ("deepseek_r1", "", "<think>Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", "<think>\n", "Two plus two.</think>\n\n4", "Two plus two.", "\n\n4"),
    ("deepseek_r1", "", "Still thinking when cut off", "Still thinking when cut off", None),
    ("deepseek_r1", "", "<think>a < b, so</think>", "a < b, so", None),
    ("qwen3", "", "<think>\nhmm\n</think>\n\nHello!", "\nhmm\n", "\n\nHello!"),
    ("qwen3", "", "\n<think>x</think>y", "x", "y"),
    ("qwen3", "", "Hello, no thinking here.", None, "Hello, no thinking here."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Direct answer.", None, "Direct answer."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "reasoning</think>content", "reasoning", "content"),
    ("qwen3", "", "<think></think>only content", "", "only content"),
]


def stream_reasoning(name: str, prompt: str, pieces: list[str]) -> tuple[str | None, str | None]:
    parser = REASONING_PARSERS[name](prompt)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return (reasoning if parser.reasoned else None), (content or None)


@pytest.mark.parametrize("name,prompt,text,reasoning,content", REASONING_CASES)
def test_reasoning_parser_whole_and_streamed(name, prompt, text, reasoning, content):
    assert REASONING_PARSERS[name]().extract(text, prompt) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(20):
        assert stream_reasoning(name, prompt, random_pieces(text, rng)) == (reasoning, content)


def test_content_deltas_only_after_the_end_tag():
    parser = REASONING_PARSERS["deepseek_r1"]()
    seen = []
    for piece in ["<thi", "nk>abc</", "thi", "nk>", "x", "y"]:
        d = parser.feed(piece)
        seen.append((d.reasoning, d.content))
    assert seen == [("", ""), ("abc", ""), ("", ""), ("", ""), ("", "x"), ("", "y")]


# -- reasoning, then tool calls, as one choice's OutputParser runs them ---------------------------
def output_plan(choice: str, parallel: bool | None = None):  # noqa: ANN201
    from jaxengine.server.protocol import ChatCompletionRequest
    from jaxengine.server.serving_tools import ToolSettings, plan_tools

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    tool_choice = {"type": "function", "function": {"name": "b"}} if choice == "named" else choice
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=tool_choice,
                                parallel_tool_calls=parallel)
    return plan_tools(ToolSettings(True, "hermes"), req)


@pytest.mark.parametrize("choice,reasoning,text,expected", [
    ("auto", "deepseek_r1", f'plan it</think>Sure.<tool_call>{{"name": "a", "arguments": {NESTED}}}</tool_call>',
     ("plan it", "Sure.", [("a", NESTED)], "tool_calls")),
    ("auto", "qwen3", "Just text, <b>bold</b>.", (None, "Just text, <b>bold</b>.", [], "stop")),
    ("auto", None, "", (None, "", [], "stop")),
    ("required", None, f'[{{"name":"b","parameters":{WEATHER}}},{{"name":"a"}}]',
     (None, None, [("b", WEATHER), ("a", "{}")], "tool_calls")),
    ("named", None, WEATHER, (None, None, [("b", WEATHER)], "stop")),
    ("none", "deepseek_r1", "<think>x</think>", ("x", None, [], "stop")),
])
def test_output_parser_whole_equals_streamed(choice, reasoning, text, expected):
    from jaxengine.server.serving_tools import OutputParser, whole_message

    plan = output_plan(choice)
    cls = REASONING_PARSERS[reasoning] if reasoning else None
    whole = OutputParser(plan, cls, "")
    message = whole_message(whole, text)
    got = (message.reasoning_content, message.content,
           [(c.function.name, c.function.arguments) for c in message.tool_calls], whole.finish_reason("stop"))
    assert got == expected
    rng = random.Random(7)
    for _ in range(10):
        parser = OutputParser(plan, cls, "")
        deltas = [parser.feed(p) for p in random_pieces(text, rng)] + [parser.finish()]
        calls: dict[int, list[str]] = {}
        for d in deltas:
            for tc in d.tool_calls:
                if tc.id is not None:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
        assert "".join(d.reasoning for d in deltas) == (message.reasoning_content or "")
        assert "".join(d.content for d in deltas) == (message.content or "")
        assert [tuple(calls[i]) for i in sorted(calls)] == got[2]
        assert parser.finish_reason("stop") == expected[3]


def test_auto_keeps_one_call_without_parallel_tool_calls():
    from jaxengine.server.serving_tools import OutputParser, whole_message

    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    for parallel, names in ((None, ["a", "b"]), (True, ["a", "b"]), (False, ["a"])):
        message = whole_message(OutputParser(output_plan("auto", parallel), None, ""), text)
        assert [c.function.name for c in message.tool_calls] == names
