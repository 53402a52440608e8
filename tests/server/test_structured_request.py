"""Request fields -> one `StructuredOutputsParams` and the field it came from (no server needed)."""

from __future__ import annotations

import pytest

from jaxengine.server.errors import OpenAIError
from jaxengine.server.protocol import ChatCompletionRequest, CompletionRequest
from jaxengine.server.structured_request import request_constraint
from jaxengine.server.serving_tools import ToolSettings, plan_tools, required_schema

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}}


def completion(**kw) -> CompletionRequest:  # noqa: ANN003
    return CompletionRequest(prompt="p", **kw)


@pytest.mark.parametrize("fields,param,kind,value", [
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     "response_format", "json", SCHEMA),
    ({"structured_outputs": {"regex": "a+", "backend": "xgrammar"}}, "structured_outputs", "regex", "a+"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, "structured_outputs", "choice", ["x", "y"]),
    ({"guided_json": SCHEMA}, "guided_json", "json", SCHEMA),
    ({"guided_json": '{"type": "string"}'}, "guided_json", "json", '{"type": "string"}'),
    ({"guided_regex": "[0-9]+"}, "guided_regex", "regex", "[0-9]+"),
    ({"guided_choice": ["a"]}, "guided_choice", "choice", ["a"]),
    ({"guided_grammar": "start: \"a\""}, "guided_grammar", "grammar", "start: \"a\""),
])
def test_each_field_maps_to_one_constraint(fields, param, kind, value):
    c = request_constraint(completion(**fields))
    assert c is not None and c.param == param and c.params.kind == kind and getattr(c.params, kind) == value


def test_no_constraint_and_whitespace_pattern():
    assert request_constraint(completion()) is None
    assert request_constraint(completion(response_format={"type": "text"})) is None
    c = request_constraint(completion(guided_json=SCHEMA, guided_whitespace_pattern=r"[ ]?",
                                      guided_decoding_backend="outlines"))
    assert c.params.whitespace_pattern == r"[ ]?"


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "json": SCHEMA}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "[1, 2"}, "guided_json"),
])
def test_bad_constraints_name_their_field(fields, param):
    with pytest.raises(OpenAIError) as e:
        request_constraint(completion(**fields))
    assert e.value.status == 400 and e.value.param == param


def test_required_schema_per_tool_and_parallel_calls():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
                 "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "b"}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required",
                                parallel_tool_calls=False)
    schema = required_schema(req)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    a, b = schema["items"]["anyOf"]
    assert a["properties"]["name"] == {"type": "string", "enum": ["a"]} and a["required"] == ["name", "parameters"]
    assert "$defs" not in a["properties"]["parameters"] and schema["$defs"] == {"P": {"type": "string"}}
    assert b["required"] == ["name"] and "parameters" not in b["properties"]
    assert a["additionalProperties"] is False and b["additionalProperties"] is False
    plan = plan_tools(ToolSettings(), req)
    assert plan.choice == "required" and plan.constraint.param == "tools" and plan.constraint.params.json == schema
    empty = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[], tool_choice="required")
    assert plan_tools(ToolSettings(), empty).choice == "none"  # OpenAI's behaviour for no tools


def test_render_chat_passes_tools_to_the_template():
    from jaxengine.llm import render_chat
    from tests.server.fake_engine import FakeTokenizer

    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    text, _ = render_chat(FakeTokenizer(), [{"role": "user", "content": "hi"}], template, True, tools=tools)
    assert text == "[get_time]hi"
    with pytest.raises(ValueError, match="tools"):
        render_chat(FakeTokenizer(), [{"role": "user", "content": "hi"}], template, True,
                    chat_template_kwargs={"tools": tools}, tools=tools)
