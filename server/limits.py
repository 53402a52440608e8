"""What one request may ask of the server, and the guard that checks a body before anything parses it.

Every limit answers with OpenAI's error JSON and a 4xx (413 for a body that is too large, 400 for
the rest), never a 5xx, a hang or a crash. The body guard runs as the outermost layer after the
API-key check: it reads at most `max_request_body_bytes` (a larger `Content-Length` is refused
before a byte is read), then rejects bytes that are not UTF-8, JSON nested deeper than
`max_json_depth`, and strings holding lone UTF-16 surrogates (`"\\ud800"` is valid JSON but no
tokenizer or JSON encoder can handle the string it decodes to). Limits on the request's fields
(prompts per request, stop strings, ...) are checked by the handlers through `ServerLimits`.
"""

from __future__ import annotations

import dataclasses
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxengine.server.errors import OpenAIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Per-request limits. `max_queued_requests`: requests the server holds beyond the engine's
    `max_num_seqs` running ones before it answers 503 (None: no limit; they wait)."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_json_depth: int = 32
    max_prompts_per_request: int = 256
    max_stop_strings: int = 16
    max_stop_string_chars: int = 512
    max_stop_token_ids: int = 256
    max_queued_requests: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_queued_requests":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if f.name == "max_queued_requests" else 1):
                raise ValueError(f"{f.name} must be a {'non-negative' if f.name == 'max_queued_requests' else 'positive'} "
                                 f"integer, got {value!r}")

    def check_stop(self, stop: str | list[str] | None, stop_token_ids: list[int] | None) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > self.max_stop_strings:
            raise OpenAIError(f"stop has {len(stops)} strings; at most {self.max_stop_strings} are allowed.", 400,
                              param="stop")
        long = [s for s in stops if len(s) > self.max_stop_string_chars]
        if long:
            raise OpenAIError(f"stop strings may have at most {self.max_stop_string_chars} characters; one has "
                              f"{len(long[0])}.", 400, param="stop")
        if stop_token_ids is not None and len(stop_token_ids) > self.max_stop_token_ids:
            raise OpenAIError(f"stop_token_ids has {len(stop_token_ids)} ids; at most {self.max_stop_token_ids} "
                              "are allowed.", 400, param="stop_token_ids")

    def check_num_prompts(self, num: int) -> None:
        if num > self.max_prompts_per_request:
            raise OpenAIError(f"prompt holds {num} prompts; at most {self.max_prompts_per_request} are allowed "
                              "per request.", 400, param="prompt")


def check_json_body(body: bytes, max_depth: int) -> OpenAIError | None:
    """The reason `body` is refused before validation, or None. Malformed JSON is left to the
    validator (which names the position); this only catches what would break later layers."""
    if not body:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return OpenAIError(f"The request body is not valid UTF-8 (byte {e.start}).", 400)
    try:
        value = json.loads(text)
    except RecursionError:
        return _too_deep(max_depth)
    except ValueError:
        return None
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth > max_depth:
                return _too_deep(max_depth)
            for k, v in item.items():
                if _has_surrogate(k):
                    return _surrogate()
                stack.append((v, depth + 1))
        elif isinstance(item, list):
            if depth > max_depth:
                return _too_deep(max_depth)
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str) and _has_surrogate(item):
            return _surrogate()
    return None


def _has_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _too_deep(max_depth: int) -> OpenAIError:
    return OpenAIError(f"The JSON body is nested too deeply (more than {max_depth} levels).", 400)


def _surrogate() -> OpenAIError:
    return OpenAIError("The request body holds a lone UTF-16 surrogate escape (such as \\ud800); strings must be "
                       "valid Unicode.", 400)


class BodyGuardMiddleware:
    """Reads request bodies (POST, PUT, PATCH) up to the size limit and checks them (see the
    module docstring) before the app sees them; then replays the body to the app. A plain ASGI
    middleware: responses, streaming and disconnect messages pass through untouched."""

    def __init__(self, app: ASGIApp, limits: ServerLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_request_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await OpenAIError("The Content-Length header is not a number.", 400).response()(scope, receive, send)
                return
            if size > limit:
                await _too_large(size, limit)(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _too_large(size, limit, at_least=True)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        error = check_json_body(body, self.limits.max_json_depth)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later messages: the disconnect watcher's http.disconnect

        await self.app(scope, replay, send)


def _too_large(size: int, limit: int, at_least: bool = False):  # noqa: ANN202 - a JSONResponse
    got = f"at least {size}" if at_least else str(size)
    return OpenAIError(f"The request body has {got} bytes; at most {limit} are allowed "
                       "(--max-request-body-bytes).", 413, code="request_too_large").response()
