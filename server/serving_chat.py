"""`POST /v1/chat/completions`: the conversation rendered with the chat template (the model's own or
`--chat-template`) exactly as `LLM.chat` renders it, then one engine request with n choices (with
`use_beam_search`, the n best beams: server/serving_beam.py).

Each choice's text goes through an `OutputParser` (server/serving_tools.py): reasoning
(`--reasoning-parser`) and tool calls (`tools` / `tool_choice`) are split out of it, the same way
whether answered whole or streamed. Streaming sends, per choice, a role delta first
(`{"role": "assistant", "content": ""}`), then reasoning / content / tool-call deltas, then a last
chunk with an empty delta and the finish_reason; with
`stream_options.include_usage` a usage chunk with no choices follows, then `data: [DONE]`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import jinja2
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from jaxengine.llm import render_chat
from jaxengine.async_engine import RequestStream
from jaxengine.server.errors import EngineDeadError, OpenAIError
from jaxengine.server.reasoning_parsers import REASONING_PARSERS
from jaxengine.server.serving_beam import beam_chat
from jaxengine.server.stream_chunks import ChunkTemplate, chat_content_choice
from jaxengine.server.serving_tools import (OutputDelta, OutputParser, chat_constraint, plan_tools, template_tools,
                                            whole_message)
from jaxengine.server.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                       ChatCompletionStreamResponse, ChatMessage, ChatStreamChoice, ChoiceLogprobs,
                                       DeltaMessage)
from jaxengine.server.serving_common import (SSE_DONE, ChoiceState, ServingContext, chat_logprobs,
                                             chat_logprobs_setting, close_all_on_loop, open_streams,
                                             prompt_logprobs_json, reject_unsupported, stream_error_event,
                                             sampling_params, sse, until_disconnected, usage)

logger = logging.getLogger(__name__)


def render_messages(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool,
                    chat_template_kwargs: dict[str, object] | None = None,
                    tools: list[dict[str, object]] | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a conversation (with `tools` for the template); template
    failures are the caller's 400."""
    if continue_final_message and add_generation_prompt:
        raise OpenAIError("add_generation_prompt and continue_final_message cannot both be true.", 400,
                          param="continue_final_message")
    if continue_final_message and messages[-1].role != "assistant":
        raise OpenAIError("continue_final_message needs the last message to be an assistant message.", 400,
                          param="messages")
    conversation = [m.template_dict() for m in messages]
    try:
        return render_chat(ctx.tokenizer, conversation, ctx.chat_template, add_generation_prompt,
                           continue_final_message, chat_template_kwargs, tools)
    except ValueError as e:
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
        raise OpenAIError(str(e), 400, param=param) from e
    except (jinja2.TemplateError, TypeError) as e:  # TypeError: a value the template cannot use
        raise OpenAIError(f"The chat template could not render these messages: {e}", 400,
                          param="chat_template_kwargs" if chat_template_kwargs else "messages") from e


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    reject_unsupported(req)
    top_logprobs = chat_logprobs_setting(req)
    ctx.limits.check_stop(req.stop, req.stop_token_ids)
    plan = plan_tools(ctx.tools, req)
    constraint = chat_constraint(req, plan)
    if plan.parser is not None and plan.parser.special_tokens_in_text:
        req = req.model_copy(update={"skip_special_tokens": False})  # the call tags are special tokens
    text, ids = render_messages(ctx, req.messages, req.add_generation_prompt, req.continue_final_message,
                                req.chat_template_kwargs, template_tools(req))
    ids = ctx.truncate(ids, req.truncate_prompt_tokens)
    max_tokens = req.max_new_tokens
    max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    ctx.check_prompt(len(ids), max_tokens, "messages", max_name)
    if req.use_beam_search:
        if plan.choice != "none":
            raise OpenAIError("tool calling is not available with use_beam_search.", 400, param="tool_choice")
        return await beam_chat(ctx, req, raw, model, (text, ids))
    params = sampling_params(req, max_tokens, top_logprobs, structured=constraint.params if constraint else None)
    # A constrained output has no room for thinking tags: it is not split into reasoning.
    reasoning = REASONING_PARSERS.get(ctx.tools.reasoning_parser or "") if constraint is None else None

    def parser() -> OutputParser:
        return OutputParser(plan, reasoning, text)

    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    [stream] = await open_streams(ctx, request_id, [(text, ids)], params, ctx.lora_request(model),
                                  constraint.param if constraint else None)
    if req.stream:
        return StreamingResponse(_stream(req, model, request_id, stream, len(ids), top_logprobs,
                                         params.output_text_buffer_length, parser), media_type="text/event-stream",
                                 # closes the stream even if the body never started
                                 background=BackgroundTask(close_all_on_loop, [stream]))
    result = await until_disconnected(raw, _collect(req, model, request_id, stream, top_logprobs, parser))
    if result is None:
        return Response(status_code=499)
    return Response(result.model_dump_json(), media_type="application/json")


async def _collect(req: ChatCompletionRequest, model: str, request_id: str, stream: RequestStream,
                   top_logprobs: int | None, parser: Callable[[], OutputParser]) -> ChatCompletionResponse:
    final = None
    try:
        async for out in stream:
            final = out
    finally:
        stream.close()
    if final is None:
        raise EngineDeadError("the request ended without a final output")
    choices = []
    for c in final.outputs:
        lp = None
        if top_logprobs is not None and c.logprobs is not None:
            lp = ChoiceLogprobs(content=chat_logprobs(c.token_ids, c.logprobs[:len(c.token_ids)], top_logprobs))
        p = parser()
        message = whole_message(p, c.text)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=lp,
                                  finish_reason=p.finish_reason(c.finish_reason), stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    prompt_lps = prompt_logprobs_json(final.prompt_logprobs) if req.prompt_logprobs is not None else None
    return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=usage(len(final.prompt_token_ids), completion_tokens,
                                              final.num_cached_tokens), prompt_logprobs=prompt_lps)


async def _stream(req: ChatCompletionRequest, model: str, request_id: str, stream: RequestStream,
                  prompt_tokens: int, top_logprobs: int | None, hold: int,
                  parser: Callable[[], OutputParser]) -> AsyncIterator[str]:
    """SSE chunks; `hold`: characters held back from unfinished text (a stop string may start there);
    each choice's text goes through its own `parser()` (reasoning, tool calls)."""
    created = int(time.time())
    states = [ChoiceState() for _ in range(req.n)]
    parsers = [parser() for _ in range(req.n)]
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)

    def chunk(choice: ChatStreamChoice) -> str:
        u = usage(prompt_tokens, sum(s.tokens_sent for s in states)) if continuous else None
        return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice],
                                                usage=u).model_dump_json())

    # A content-only chunk without logprobs or usage, written from a template (server/stream_chunks.py).
    plain = None if continuous else ChunkTemplate(ChatCompletionStreamResponse(id=request_id, created=created,
                                                                               model=model, choices=[]))

    try:
        for i in range(req.n):
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        async for out in stream:
            for c in out.outputs:
                d = states[c.index].delta(c, hold)
                if d is None:
                    continue
                lp = None
                if top_logprobs is not None and d.logprobs is not None and d.token_ids:
                    lp = ChoiceLogprobs(content=chat_logprobs(d.token_ids, d.logprobs, top_logprobs))
                p = parsers[c.index]
                parts = p.feed(d.text)
                if plain is not None and lp is None and parts.content and not parts.reasoning \
                        and not parts.tool_calls:
                    yield plain.event(chat_content_choice(c.index, parts.content))
                elif parts or lp is not None:
                    yield chunk(ChatStreamChoice(index=c.index, delta=_delta(parts), logprobs=lp))
                if d.finish_reason is not None:
                    rest = p.finish()
                    if rest:
                        yield chunk(ChatStreamChoice(index=c.index, delta=_delta(rest)))
                    yield chunk(ChatStreamChoice(index=c.index, delta=DeltaMessage(),
                                                 finish_reason=p.finish_reason(d.finish_reason),
                                                 stop_reason=d.stop_reason))
        if include_usage:
            completion_tokens = sum(s.tokens_sent for s in states)
            yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                   usage=usage(prompt_tokens, completion_tokens)).model_dump_json())
        yield SSE_DONE
    except Exception as e:  # noqa: BLE001 - headers are sent: the error can only travel in the stream
        yield stream_error_event(e, request_id)
        yield SSE_DONE
    finally:
        stream.close()


def _delta(parts: OutputDelta) -> DeltaMessage:
    """A chunk's delta: the parts a piece of output produced (only non-empty ones are sent)."""
    return DeltaMessage(content=parts.content or None, reasoning_content=parts.reasoning or None,
                        tool_calls=parts.tool_calls or None)
