"""A request's output constraint: `response_format`, `structured_outputs` or vLLM's older
`guided_*` fields, as one `StructuredOutputsParams` plus the request field it came from.

At most one constraint per request; a second one is a 400 naming it. The constraint's own
validity (a schema, regex or grammar the backend cannot compile) is checked by the engine when the
request is added; `open_streams` turns that `ValueError` into a 400 whose `param` is the field
returned here, so the client learns which of its fields was wrong.
"""

from __future__ import annotations

import dataclasses

from jaxengine.structured_outputs import StructuredOutputsParams
from jaxengine.server.errors import OpenAIError
from jaxengine.server.protocol import SamplingFields

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """An output constraint and the request field that asked for it (the `param` of its 400s)."""

    params: StructuredOutputsParams
    param: str


def request_constraint(req: SamplingFields) -> Constraint | None:
    """The constraint `req` asks for through its structured-output fields, or None."""
    found: list[tuple[str, dict[str, object]]] = []  # (field, StructuredOutputsParams kwargs)
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _response_format_kwargs(req)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name in GUIDED:
        value = getattr(req, name)
        if value is not None:
            found.append((name, {name.removeprefix("guided_"): value}))
    if not found:
        return None
    if len(found) > 1:
        names = [f for f, _ in found]
        raise OpenAIError(f"Only one structured-output constraint may be given per request, but {', '.join(names)} "
                          "are all set.", 400, param=names[1])
    param, kwargs = found[0]
    if req.guided_whitespace_pattern is not None and param != "structured_outputs":
        kwargs["whitespace_pattern"] = req.guided_whitespace_pattern
    return constraint(param, kwargs)


def constraint(param: str, kwargs: dict[str, object]) -> Constraint:
    """`StructuredOutputsParams(**kwargs)` from field `param`; a malformed one is a 400 naming it."""
    try:
        return Constraint(StructuredOutputsParams.from_dict(kwargs), param)
    except (ValueError, TypeError) as e:
        raise OpenAIError(f"{param}: {e}", 400, param=param) from e


def _response_format_kwargs(req: SamplingFields) -> dict[str, object]:
    rf = req.response_format
    assert rf is not None
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise OpenAIError('response_format of type "json_schema" needs json_schema.schema (a JSON schema).', 400,
                          param="response_format")
    return {"json": rf.json_schema.schema_}
