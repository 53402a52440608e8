"""`POST /v1/completions`: one engine request per prompt, n choices each (choice index = prompt
index * n + sequence index, as OpenAI numbers them), answered whole or streamed as SSE chunks.
With `use_beam_search` the n choices are the n best beams instead (server/serving_beam.py)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from jaxengine.outputs import RequestOutput
from jaxengine.async_engine import RequestStream
from jaxengine.server.errors import EngineDeadError, OpenAIError
from jaxengine.server.serving_beam import beam_completion
from jaxengine.server.stream_chunks import ChunkTemplate, completion_choice
from jaxengine.server.structured_request import request_constraint
from jaxengine.server.protocol import (CompletionChoice, CompletionLogProbs, CompletionRequest,
                                       CompletionResponse, CompletionStreamResponse)
from jaxengine.server.serving_common import (SSE_DONE, ChoiceState, ServingContext, close_all, close_all_on_loop,
                                             completion_logprobs, echo_logprobs, join_logprobs, merge_streams,
                                             open_streams, prompt_logprobs_json, reject_unsupported, sampling_params,
                                             sse, stream_error_event, until_disconnected, usage)

logger = logging.getLogger(__name__)

Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)


def completion_prompts(ctx: ServingContext, req: CompletionRequest) -> list[Prompt]:
    p = req.prompt
    if isinstance(p, str):
        return [(p, ctx.tokenize(p, req.add_special_tokens))]
    if not p:
        raise OpenAIError("prompt must not be an empty list.", 400, param="prompt")
    if not isinstance(p[0], int):
        ctx.limits.check_num_prompts(len(p))
    if isinstance(p[0], str):
        return [(s, ctx.tokenize(s, req.add_special_tokens)) for s in p]  # type: ignore[arg-type]
    if isinstance(p[0], int):
        return [(None, list(p))]  # type: ignore[arg-type]
    return [(None, list(ids)) for ids in p]  # type: ignore[union-attr]


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    reject_unsupported(req)
    ctx.limits.check_stop(req.stop, req.stop_token_ids)
    prompts = [(text, ctx.truncate(ids, req.truncate_prompt_tokens)) for text, ids in completion_prompts(ctx, req)]
    for _, ids in prompts:
        ctx.check_prompt(len(ids), req.max_tokens, "prompt")
    if req.use_beam_search:
        return await beam_completion(ctx, req, raw, model, prompts)
    echo_lp = req.echo and req.logprobs is not None  # the prompt's tokens get logprobs too
    constraint = request_constraint(req)
    params = sampling_params(req, req.max_tokens, req.logprobs,
                             max(req.prompt_logprobs or 0, req.logprobs or 0) if echo_lp else None,
                             constraint.params if constraint else None)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await open_streams(ctx, request_id, prompts, params, ctx.lora_request(model),
                                 constraint.param if constraint else None)
    echo = [_prompt_text(ctx, p) if req.echo else "" for p in prompts]
    if req.stream:
        # The background task closes the streams even if the client left before the body started
        # (then the generator never runs, and neither does its `finally`).
        return StreamingResponse(_stream(ctx, req, model, request_id, streams, prompts, echo,
                                         params.output_text_buffer_length),
                                 media_type="text/event-stream", background=BackgroundTask(close_all_on_loop, streams))
    result = await until_disconnected(raw, _collect(ctx, req, model, request_id, streams, prompts, echo))
    if result is None:
        return Response(status_code=499)
    return Response(result.model_dump_json(), media_type="application/json")


def _prompt_text(ctx: ServingContext, prompt: Prompt) -> str:
    text, ids = prompt
    return text if text is not None else ctx.tokenizer.decode(ids)


def _echo_logprobs(ctx: ServingContext, prompt: Prompt, out: RequestOutput) -> tuple[CompletionLogProbs, int]:
    """The prompt's part of `logprobs` with echo, and the text offset where the output's part starts."""
    lp = echo_logprobs(ctx.tokenizer, prompt[1], out.prompt_logprobs or [])
    end = lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else 0
    return lp, end


async def _collect(ctx: ServingContext, req: CompletionRequest, model: str, request_id: str, streams: Sequence[RequestStream],
                   prompts: Sequence[Prompt], echo: Sequence[str]) -> CompletionResponse:
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merge_streams(streams):
            finals[i] = out
    finally:
        close_all(streams)
    choices, completion_tokens, cached = [], 0, 0
    for i, out in enumerate(finals):
        if out is None:
            raise EngineDeadError("a request ended without a final output")
        cached += out.num_cached_tokens or 0
        prefix, offset = _echo_logprobs(ctx, prompts[i], out) if req.echo and req.logprobs is not None else (None, 0)
        prompt_lps = prompt_logprobs_json(out.prompt_logprobs) if req.prompt_logprobs is not None else None
        for c in out.outputs:
            lp = None
            if req.logprobs is not None and c.logprobs is not None:
                lp = completion_logprobs(c.token_ids, c.logprobs[:len(c.token_ids)], offset)
                lp = join_logprobs(prefix, lp) if prefix is not None else lp
            choices.append(CompletionChoice(index=i * req.n + c.index, text=echo[i] + c.text, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_logprobs=prompt_lps))
            completion_tokens += len(c.token_ids)
    choices.sort(key=lambda c: c.index)
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    return CompletionResponse(id=request_id, model=model, choices=choices,
                              usage=usage(prompt_tokens, completion_tokens, cached))


async def _stream(ctx: ServingContext, req: CompletionRequest, model: str, request_id: str,
                  streams: Sequence[RequestStream], prompts: Sequence[Prompt],
                  echo: Sequence[str], hold: int) -> AsyncIterator[str]:
    """SSE chunks; `hold`: characters held back from unfinished text (a stop string may start there)."""
    created = int(time.time())
    n = req.n
    states: dict[int, ChoiceState] = {}
    offsets: dict[int, int] = {}  # choice -> characters of token text so far (logprobs' text_offset)
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    prompt_tokens = sum(len(ids) for _, ids in prompts)

    def chunk(choices: list[CompletionChoice]) -> str:
        u = None
        if continuous:
            u = usage(prompt_tokens, sum(s.tokens_sent for s in states.values()))
        return sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                            usage=u).model_dump_json())

    # The per-token chunk without logprobs or usage, written from a template (server/stream_chunks.py).
    plain = None if continuous else ChunkTemplate(CompletionStreamResponse(id=request_id, created=created,
                                                                           model=model, choices=[]))

    # With logprobs the echoed prompt waits for the first output, which carries the prompt's logprobs.
    echo_pending = {i for i, text in enumerate(echo) if text and req.logprobs is not None}
    try:
        for i, text in enumerate(echo):
            if text and i not in echo_pending:
                for j in range(n):
                    yield chunk([CompletionChoice(index=i * n + j, text=text)])
        async for i, out in merge_streams(streams):
            if i in echo_pending:
                echo_pending.discard(i)
                prefix, end = _echo_logprobs(ctx, prompts[i], out)
                for j in range(n):
                    offsets[i * n + j] = end
                    yield chunk([CompletionChoice(index=i * n + j, text=echo[i], logprobs=prefix)])
            for c in out.outputs:
                index = i * n + c.index
                state = states.setdefault(index, ChoiceState())
                d = state.delta(c, hold)
                if d is None:
                    continue
                lp = None
                if req.logprobs is not None and d.logprobs is not None:
                    lp = completion_logprobs(d.token_ids, d.logprobs, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp.tokens)
                elif plain is not None:
                    yield plain.event(completion_choice(index, d.text, d.finish_reason, d.stop_reason))
                    continue
                yield chunk([CompletionChoice(index=index, text=d.text, logprobs=lp,
                                              finish_reason=d.finish_reason, stop_reason=d.stop_reason)])
        if include_usage:
            completion_tokens = sum(s.tokens_sent for s in states.values())
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                               usage=usage(prompt_tokens, completion_tokens)).model_dump_json())
        yield SSE_DONE
    except Exception as e:  # noqa: BLE001 - headers are sent: the error can only travel in the stream
        yield stream_error_event(e, request_id)
        yield SSE_DONE
    finally:
        close_all(streams)
