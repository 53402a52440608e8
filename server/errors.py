"""Errors as OpenAI sends them: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Every failure a client can cause (bad JSON, wrong types, unknown fields, out-of-range values,
unknown model, missing API key) becomes one of these, so the official clients raise their usual
exception classes (`BadRequestError`, `NotFoundError`, `AuthenticationError`, ...). Handlers raise
`OpenAIError`; the exception handlers installed by `install_error_handlers` turn everything else
(FastAPI validation errors, engine `ValueError`s, HTTP errors, crashes) into the same shape.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxengine.exceptions import EngineDeadError, RequestFailedError  # noqa: F401  (answered here)

logger = logging.getLogger(__name__)

# OpenAI's `type` per status class: 4xx are the caller's, 5xx the server's.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          500: "server_error", 503: "server_error"}


class OpenAIError(Exception):
    """An error response: HTTP status plus OpenAI's error object."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, dict[str, object]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one Server-Sent Event (for failures after a stream has started)."""
        return f"data: {json.dumps(self.body())}\n\n"


def overloaded(num_open: int, capacity: int) -> OpenAIError:
    """The 503 for a full queue: the client should retry later."""
    return OpenAIError(f"The server is overloaded: {num_open} requests are running or queued and at most "
                       f"{capacity} are allowed (--max-queued-requests). Please retry later.", 503,
                       code="server_overloaded", headers={"Retry-After": "1"})


def from_value_error(e: ValueError, known_params: set[str] | None = None) -> OpenAIError:
    """A `ValueError` from the engine or `SamplingParams` as a 400; `param` is the field its message names."""
    msg = str(e)
    m = re.match(r"([a-z_]+)\b", msg)
    param = m.group(1) if m and known_params and m.group(1) in known_params else None
    return OpenAIError(msg, 400, param=param)


# Union members show up in error locations ('str', 'list[int]'); they are not field names.
_UNION_TAG = re.compile(r"[a-z]+\[.*\]|str|int|float|bool|constrained-[a-z]+|function-.*|[A-Z][A-Za-z]*Request")


def _loc_to_param(loc: tuple[object, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if not _UNION_TAG.fullmatch(p)]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI/pydantic validation errors as one 400, naming every offending field."""
    errors = exc.errors()
    unknown = [".".join(filter(None, [_loc_to_param(tuple(e["loc"])[:-1]), str(e["loc"][-1])]))
               for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        names = ", ".join(str(u) for u in unknown)
        return OpenAIError(f"Unrecognized request argument supplied: {names}", 400, param=unknown[0])
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return OpenAIError(f"We could not parse the JSON body of your request ({detail}). The body must be "
                           "valid JSON.", 400)
    seen: dict[str | None, str] = {}
    tags: dict[str | None, list[str]] = {}  # union members tried per field
    for e in errors:
        loc = tuple(e["loc"])
        param = _loc_to_param(loc)
        tag = next((str(p) for p in loc if isinstance(p, str) and _UNION_TAG.fullmatch(p)), None)
        field = _loc_to_param(loc[:loc.index(tag)]) if tag is not None else None
        if tag is not None and field is not None:  # a union-typed field (not the body's own union)
            if tag not in tags.setdefault(field, []):
                tags[field].append(tag)
            param = field
        seen.setdefault(param, e.get("msg", "invalid value"))
    for field, members in tags.items():
        if len(members) > 1:
            seen[field] = "expected one of: " + ", ".join(members).replace("constrained-int", "int")
    parts = [f"{p}: {m}" if p else m for p, m in seen.items()]
    return OpenAIError("Invalid request: " + "; ".join(parts), 400, param=next(iter(seen)))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        if exc.status_code == 404 and exc.detail in (None, phrase):  # a route this server does not have
            return OpenAIError(f"{request.method} {request.url.path} is not served by this server (jaxengine "
                               "serves the completions, chat completions, embeddings, pooling, classify, "
                               "score, rerank, models, tokenize and detokenize routes)", 404, code="route_not_found").response()
        message = exc.detail if isinstance(exc.detail, str) and exc.detail != phrase else phrase
        return OpenAIError(message, exc.status_code).response()

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return from_value_error(exc).response()

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return OpenAIError(f"The request failed in the engine: {exc}", 500).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return OpenAIError(f"The engine is not running: {exc}", 503).response()

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return OpenAIError(f"Internal server error: {type(exc).__name__}: {exc}", 500).response()
