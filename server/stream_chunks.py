"""The streamed chunks of the common case, written as strings instead of through pydantic.

At rate inf a server streaming to many clients writes one chunk per request per engine step, on
the event loop, while the engine thread waits for the GIL; building a `CompletionStreamResponse`
and dumping it was a large share of a chunk's work there. A chunk with plain text (no logprobs, no
continuous usage, no tool calls or reasoning) is the same JSON every time but for a few values, so
it is written here from a template: everything around `"choices":[...]` is pydantic's own dump of
the response with no choices, made once per request, and a choice is an f-string. The bytes are
those pydantic writes (tests/server/test_stream_chunks.py compares them over tricky strings);
anything else still goes through the models.
"""

from __future__ import annotations

from json.encoder import encode_basestring  # quotes and escapes as pydantic does; non-ASCII as is

from pydantic import BaseModel

_CHOICES = '"choices":[]'


class ChunkTemplate:
    """The SSE events of one streamed response: `event(choice_json)` is `data: <response with that
    one choice>\\n\\n`, byte for byte what the model with the same fields dumps."""

    def __init__(self, empty: BaseModel):
        """`empty`: the response with `choices=[]` and every other field as each chunk has it."""
        dumped = empty.model_dump_json()
        # A JSON string escapes its quotes, so the key can only appear once, as the key itself.
        assert dumped.count(_CHOICES) == 1, dumped
        head, tail = dumped.split(_CHOICES)
        self._head = f'data: {head}"choices":['
        self._tail = f"]{tail}\n\n"

    def event(self, choice_json: str) -> str:
        return f"{self._head}{choice_json}{self._tail}"


def _opt(value: int | str | None) -> str:
    """A `str | int | None` field's JSON (finish_reason, stop_reason)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return encode_basestring(value)
    return str(int(value))  # a token id (a numpy integer would pass too)


def completion_choice(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
    """A `CompletionChoice` without logprobs (what `model_dump_json` gives)."""
    return (f'{{"index":{index},"text":{encode_basestring(text)},"logprobs":null,'
            f'"finish_reason":{_opt(finish_reason)},"stop_reason":{_opt(stop_reason)},"prompt_logprobs":null}}')


def chat_content_choice(index: int, content: str) -> str:
    """A `ChatStreamChoice` whose delta is only `content` (no logprobs, not finished)."""
    return (f'{{"index":{index},"delta":{{"content":{encode_basestring(content)}}},"logprobs":null,'
            f'"finish_reason":null,"stop_reason":null}}')
