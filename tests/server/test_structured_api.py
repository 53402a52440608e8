"""Structured outputs, tool calling and reasoning end to end, with the official `openai` client
against a live server on the real SmolLM2-135M-Instruct (the default model): outputs follow
`response_format` / `guided_*` / `structured_outputs`, `tool_choice` "required" and named calls
parse and validate against the tool's schema, streamed deltas concatenate to the non-streamed
response, and bad requests are 400s naming the field.

The server runs with `--enable-auto-tool-choice` and `--reasoning-parser qwen3` on a ChatML
chat template that lists tools Hermes-style (so the tool call parser is picked from it) and
opens `<think>` when `chat_template_kwargs` asks for thinking.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from jaxengine.async_engine import AsyncEngine
from jaxengine.server.api_server import build_app
from jaxengine.server.serving_tools import ToolSettings
from tests.server.conftest import LiveServer
from tests.server.fake_engine import FakeEngine

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(xla_cache_dir):
    from jaxengine.config import EngineConfig
    from jaxengine.engine import LLMEngine

    from tests.engine.test_structured_outputs import ENGINE_KW

    # The structured-output engine tests' settings: their compiled programs are reused from the cache.
    engine = LLMEngine(EngineConfig(model=None, compilation_cache_dir=xla_cache_dir, **ENGINE_KW))
    tools = ToolSettings(enable_auto_tool_choice=True, reasoning_parser="qwen3")  # the parser: from the template
    app = build_app(AsyncEngine(engine), chat_template=TEMPLATE, tool_settings=tools)
    assert app.state.ctx.tools.tool_call_parser == "hermes"
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, **kw):  # noqa: ANN201
    kw = {"messages": ASK, "temperature": 0, "max_tokens": 60, **kw}
    return client.chat.completions.create(model=MODEL, **kw)


def joined_stream(client: openai.OpenAI, **kw) -> tuple[dict, str | None]:
    """The streamed message, put together from its deltas, and the finish_reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [calls[i] for i in sorted(calls)]}, finish


def message_calls(message) -> list[dict]:  # noqa: ANN001
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


def without_ids(calls: list[dict]) -> list[dict]:
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


# -- response_format and the guided fields -----------------------------------------------------
def test_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = chat(client, messages=[{"role": "user", "content": "Invent a person."}], response_format=fmt)
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    streamed, finish = joined_stream(client, messages=[{"role": "user", "content": "Invent a person."}],
                                     response_format=fmt)
    assert streamed["content"] == reply.choices[0].message.content and finish == reply.choices[0].finish_reason


def test_response_format_json_object(client):
    reply = chat(client, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                 response_format={"type": "json_object"}, max_tokens=120)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


def test_client_parse_with_a_pydantic_model(client):
    reply = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                               response_format=Person, temperature=0, max_tokens=60)
    assert isinstance(reply.choices[0].message.parsed, Person)


def test_completions_guided_fields(client, server):
    choice = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["blue", "green", "on fire"]})
    assert choice.choices[0].text in ("blue", "green", "on fire")
    regex = r"[0-9]{3}-[0-9]{4}"
    got = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, temperature=0,
                                    extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, got.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=12, temperature=0, stream=True,
        extra_body={"guided_regex": regex}) if c.choices)
    assert streamed == got.choices[0].text
    so = client.completions.create(model=MODEL, prompt="A person:", max_tokens=60, temperature=0,
                                   extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(so.choices[0].text), PERSON)
    r = post(server, "/v1/completions", {"prompt": "Yes or no?", "max_tokens": 4, "temperature": 0,
                                         "guided_json": {"type": "boolean"}, "guided_decoding_backend": "xgrammar"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("true", "false")


# -- tool calling ----------------------------------------------------------------------------------
@pytest.mark.parametrize("parallel", [None, False])
def test_tool_choice_required(client, parallel):
    kw = {"tools": TOOLS, "tool_choice": "required"}
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    reply = chat(client, **kw)
    choice = reply.choices[0]
    calls = message_calls(choice.message)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and calls
    if parallel is False:
        assert len(calls) == 1
    for call in calls:
        assert call["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    streamed, finish = joined_stream(client, **kw)
    assert finish == "tool_calls" and streamed["content"] is None
    assert without_ids(streamed["calls"]) == without_ids(calls)


def test_tool_choice_named_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = chat(client, tools=TOOLS, tool_choice=named)
    choice = reply.choices[0]
    [call] = message_calls(choice.message)
    assert call["name"] == "get_time" and choice.message.content is None
    assert choice.finish_reason == "stop"  # as vLLM: a named function keeps the engine's reason
    jsonschema.validate(json.loads(call["arguments"]), TIME)
    streamed, finish = joined_stream(client, tools=TOOLS, tool_choice=named)
    assert finish == "stop" and without_ids(streamed["calls"]) == without_ids([call])


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


def test_client_parses_tool_calls_into_pydantic_models(client):
    reply = client.beta.chat.completions.parse(model=MODEL, messages=ASK, temperature=0, max_tokens=60,
                                               tools=[openai.pydantic_function_tool(GetWeather)],
                                               tool_choice="required", parallel_tool_calls=False)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


def test_tool_choice_auto_is_well_formed(client):
    """The tiny model rarely calls a tool: whatever it does, the response is well-formed (the
    parsing itself is tested in test_tool_parsers.py)."""
    for kw in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        kw["max_tokens"] = 24
        choice = chat(client, **kw).choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        for call in message_calls(choice.message):
            assert call["name"] in SCHEMAS
        assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
        streamed, finish = joined_stream(client, **kw)
        assert finish == choice.finish_reason and streamed["content"] == choice.message.content


def test_tools_reach_the_template_and_tool_turns_render(client, server):
    plain = chat(client, max_tokens=1).usage.prompt_tokens
    with_tools = chat(client, max_tokens=1, tools=TOOLS, tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain + 50
    assert not with_tools.choices[0].message.tool_calls
    tokenized = post(server, "/tokenize", {"messages": ASK, "tools": TOOLS, "return_token_strs": True}).json()
    assert tokenized["count"] == with_tools.usage.prompt_tokens
    assert '"get_weather"' in "".join(tokenized["token_strs"]).replace("Ġ", " ")
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    reply = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert reply.usage.prompt_tokens > with_tools.usage.prompt_tokens + 20


# -- reasoning -----------------------------------------------------------------------------------
def test_reasoning_follows_chat_template_kwargs(client):
    on = chat(client, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = on.choices[0].message
    assert message.reasoning_content and message.content is None  # no </think> in 12 tokens
    streamed, _ = joined_stream(client, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert streamed["reasoning"] == message.reasoning_content and streamed["content"] is None
    off = chat(client, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.reasoning_content is None and off.choices[0].message.content
    assert off.choices[0].message.content == chat(client, max_tokens=12).choices[0].message.content


# -- errors ---------------------------------------------------------------------------------------
def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "typo": 1}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_requests_name_the_field(server, body, param):
    err = error_of(post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body}))
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_completions_bad_constraints(server):
    err = error_of(post(server, "/v1/completions", {"prompt": "x", "guided_choice": ["a"], "guided_regex": "b"}))
    assert err["param"] == "guided_choice" and "guided_regex" in err["message"]  # the second in field order
    err = error_of(post(server, "/v1/completions", {"prompt": "x", "guided_json": "{not json"}))
    assert err["param"] == "guided_json"


def test_auto_tool_choice_needs_the_flag():
    """Without --enable-auto-tool-choice, "auto" (also as the default with tools) is vLLM's 400."""
    with LiveServer(build_app(AsyncEngine(FakeEngine()), served_model_names=[MODEL])) as srv:
        for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
            err = error_of(post(srv, "/v1/chat/completions", {"messages": ASK, **body}))
            assert err["param"] == "tool_choice" and "--enable-auto-tool-choice" in err["message"]
        r = post(srv, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "abc"

