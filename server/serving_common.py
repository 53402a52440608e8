"""What completions and chat completions share: the serving context, request -> `SamplingParams`,
prompt checks, streamed deltas per choice, logprob formats, stream merging and disconnect watching.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from fastapi import Request

from jaxengine.detokenizer import decode_token
from jaxengine.lora import LoRARequest
from jaxengine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from jaxengine.sampling_params import SamplingParams
from jaxengine.structured_outputs import StructuredOutputsParams
from jaxengine.async_engine import AsyncEngine, RequestStream
from jaxengine.server.errors import (EngineDeadError, OpenAIError, RequestFailedError, from_value_error,
                                     overloaded)
from jaxengine.server.limits import ServerLimits
from jaxengine.server.serving_lora import LoRAAdapters
from jaxengine.server.serving_tools import ToolSettings
from jaxengine.server.protocol import (ChatCompletionRequest, CompletionLogProbs, PromptLogprob,
                                       PromptTokensDetails, SamplingFields, TokenLogprob, TopLogprob, UsageInfo)
from jaxengine.server.protocol import PromptLogprobs as PromptLogprobsJSON

logger = logging.getLogger(__name__)

T = TypeVar("T")
# OpenAI clients choke on -inf; vLLM reports this instead.
MIN_LOGPROB = -9999.0
MAX_TOP_LOGPROBS = 20  # OpenAI's bound (the engine's max_logprobs may be lower: it says so)


@dataclasses.dataclass
class ServingContext:
    """Everything a handler needs besides the request (one per app)."""

    engine: AsyncEngine
    model_names: list[str]  # served names; the first is the default and the one reported
    model_path: str | None
    max_model_len: int
    chat_template: str | None = None
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
    lora: LoRAAdapters | None = None  # adapters served as models (server/serving_lora.py)
    tools: ToolSettings = dataclasses.field(default_factory=ToolSettings)  # tool / reasoning parsers

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        tok = self.engine.engine.tokenizer
        if tok is None:
            raise OpenAIError("this model has no tokenizer: send token ids", 400, param="prompt")
        return tok

    def resolve_model(self, name: str | None) -> str:
        """The model name a response reports: a served name of the base model or an adapter's."""
        if name is None:
            return self.model_names[0]
        if name not in self.model_names and self.lora_request(name) is None:
            raise OpenAIError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")
        return name

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a (resolved) model name stands for; None for the base model."""
        return self.lora.get(model) if self.lora is not None else None

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The same ids `LLMEngine.tokenize` gives (so server and `LLM.generate` agree)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def truncate(self, ids: list[int], k: int | None) -> list[int]:
        """The prompt's last `k` tokens (`truncate_prompt_tokens`; -1: max_model_len - 1)."""
        if k is None:
            return ids
        if k == 0 or k < -1 or k >= self.max_model_len:
            raise OpenAIError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len - 1}], got {k}.",
                              400, param="truncate_prompt_tokens")
        return ids[-(self.max_model_len - 1 if k == -1 else k):]

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int | None, param: str,
                     max_tokens_param: str = "max_tokens") -> None:
        """OpenAI's context-length errors (the engine checks too, but without the numbers)."""
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(f"{max_tokens_param} must be at least 1, got {max_tokens}.", 400,
                              param=max_tokens_param)
        if num_prompt_tokens == 0:
            raise OpenAIError("The prompt is empty.", 400, param=param)
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise OpenAIError(f"This model's maximum context length is {limit} tokens. However, your "
                              f"{param} has {num_prompt_tokens} tokens; at most {limit - 1} leave room for "
                              "one generated token. Please reduce the length of the input.", 400, param=param,
                              code="context_length_exceeded")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {param}, "
                              f"{max_tokens} in the completion). Please reduce the length of the {param} or "
                              "completion.", 400, param=max_tokens_param, code="context_length_exceeded")


SAMPLING_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)} | {"max_completion_tokens",
                                                                              "top_logprobs"}


def reject_unsupported(req: SamplingFields) -> None:
    names = req.unsupported_fields()  # type: ignore[attr-defined]
    if names:
        raise OpenAIError(f"Unsupported parameter(s): {', '.join(names)}. This server does not implement "
                          f"{'it' if len(names) == 1 else 'them'}; leave {'it' if len(names) == 1 else 'them'} "
                          "unset.", 400, param=names[0])
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed when stream is true.", 400, param="stream_options")


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """The request's `SamplingParams` (OpenAI defaults where the request is silent);
    `structured`: the output constraint (server/structured_request.py, server/serving_tools.py)."""
    if req.prompt_logprobs is not None and req.stream:
        raise OpenAIError("prompt_logprobs is not available when stream is true.", 400, param="prompt_logprobs")
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else req.prompt_logprobs,
            logit_bias=_clamped_logit_bias(req.logit_bias), allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words, truncate_prompt_tokens=req.truncate_prompt_tokens,
            structured_outputs=structured)
    except ValueError as e:
        raise from_value_error(e, SAMPLING_PARAM_NAMES) from e


def _clamped_logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's logit_bias with each bias clamped to [-100, 100], as vLLM does; keys stay as
    sent (SamplingParams reads them as token ids and names a key that is not one)."""
    if not bias:
        return None
    return {k: min(100.0, max(-100.0, float(v))) for k, v in bias.items()}


def chat_logprobs_setting(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise OpenAIError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}.", 400,
                          param="top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("top_logprobs requires logprobs to be true.", 400, param="top_logprobs")
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


def check_capacity(ctx: ServingContext, num_new: int) -> None:
    """503 when `num_new` more engine requests would exceed the running slots (`max_num_seqs`)
    plus `max_queued_requests`; with no queue limit, every request waits its turn."""
    queued = ctx.limits.max_queued_requests
    if queued is None:
        return
    capacity = int(ctx.engine.engine.config.max_num_seqs) + queued
    num_open = ctx.engine.num_open_requests
    if num_open + num_new > capacity:
        raise overloaded(num_open, capacity)


async def open_streams(ctx: ServingContext, request_id: str, prompts: Sequence[tuple[str | None, list[int]]],
                       params: SamplingParams, lora_request: LoRARequest | None = None,
                       constraint_param: str | None = None) -> list[RequestStream]:
    """One engine request per prompt (ids `<request_id>-<i>`), each with `lora_request` if given;
    all or none (bad input closes the rest). Refused with 503 up front if the queue limit would be
    exceeded. `constraint_param`: the request field the output constraint came from; the engine's
    complaints about the constraint (`structured_outputs...`) are 400s naming it."""
    check_capacity(ctx, len(prompts))
    engine = ctx.engine
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            prompt = {"prompt_token_ids": ids, "prompt": text}
            streams.append(await engine.add(f"{request_id}-{i}", prompt, params, lora_request=lora_request))
    except ValueError as e:
        for s in streams:
            s.close()
        if constraint_param is not None and str(e).startswith("structured_outputs"):
            raise OpenAIError(f"{constraint_param}: {e}", 400, param=constraint_param) from e
        raise from_value_error(e, SAMPLING_PARAM_NAMES) from e
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


def close_all(streams: Sequence[RequestStream]) -> None:
    """Aborts whatever is still running (a no-op for finished streams)."""
    for s in streams:
        s.close()


async def close_all_on_loop(streams: Sequence[RequestStream]) -> None:
    """`close_all` as a streamed response's background task: a coroutine runs on the event loop,
    which owns the streams; a plain function would be sent to a worker thread, once per request."""
    close_all(streams)


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


@dataclasses.dataclass
class Delta:
    """What one choice adds since the last chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # one entry per new token, when logprobs were asked
    finish_reason: str | None
    stop_reason: int | str | None


@dataclasses.dataclass
class ChoiceState:
    """Per choice: how much of the cumulative output the client already has."""

    text_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False

    def delta(self, c: CompletionOutput, hold: int) -> Delta | None:
        """The unsent part of `c`; None if nothing new. While unfinished, the last `hold`
        characters are held back: they may be the start of a stop string the engine will cut."""
        if self.finished:
            return None
        done = c.finish_reason is not None
        end = len(c.text) if done else max(len(c.text) - hold, self.text_sent)
        text = c.text[self.text_sent:end] if end > self.text_sent else ""
        ntok = len(c.token_ids)
        ids = c.token_ids[self.tokens_sent:ntok]
        lps = c.logprobs[self.tokens_sent:ntok] if c.logprobs is not None else None
        if not text and not ids and not done:
            return None
        self.text_sent = max(end, self.text_sent)
        self.tokens_sent = ntok
        self.finished = done
        return Delta(text, ids, lps, c.finish_reason, c.stop_reason)


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> UsageInfo:
    details = PromptTokensDetails(cached_tokens=cached) if cached else None
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


def _lp(x: float) -> float:
    return max(float(x), MIN_LOGPROB)


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]],
                        text_offset: int) -> CompletionLogProbs:
    """The legacy completions format: tokens, their logprobs, top alternatives, character offsets."""
    out = CompletionLogProbs()
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        token = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else ""
        out.tokens.append(token)
        out.token_logprobs.append(_lp(chosen.logprob) if chosen is not None else None)
        top = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        out.top_logprobs.append({(lp.decoded_token or ""): _lp(lp.logprob) for lp in top})
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def echo_logprobs(tokenizer, prompt_ids: Sequence[int],  # noqa: ANN001 - a transformers tokenizer
                  entries: PromptLogprobs) -> CompletionLogProbs:
    """The prompt part of `logprobs` with `echo` (the first token has no logprob: null)."""
    out = CompletionLogProbs()
    offset = 0
    for pos, tid in enumerate(prompt_ids):
        entry = entries[pos] if pos < len(entries) else None
        if entry is None or tid not in entry:
            token = decode_token(tokenizer, tid)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            token = entry[tid].decoded_token or ""
            out.token_logprobs.append(_lp(entry[tid].logprob))
            top = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
            out.top_logprobs.append({(lp.decoded_token or ""): _lp(lp.logprob) for lp in top})
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def join_logprobs(a: CompletionLogProbs, b: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs +
                              b.token_logprobs, tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def prompt_logprobs_json(entries: PromptLogprobs | None) -> PromptLogprobsJSON | None:
    """vLLM's `prompt_logprobs`: per prompt position, token id -> {logprob, rank, decoded_token}."""
    if entries is None:
        return None
    return [None if e is None else {tid: PromptLogprob(logprob=_lp(lp.logprob), rank=lp.rank,
                                                       decoded_token=lp.decoded_token) for tid, lp in e.items()}
            for e in entries]


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], top_k: int) -> list[TokenLogprob]:
    """The chat format: per token its text, logprob, UTF-8 bytes and the `top_k` most likely tokens."""
    out = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        token = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else ""
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_k),
                        key=lambda lp: lp.rank)[:top_k]
        tops = [TopLogprob(token=lp.decoded_token or "", logprob=_lp(lp.logprob),
                           bytes=list((lp.decoded_token or "").encode("utf-8"))) for lp in ranked]
        out.append(TokenLogprob(token=token, logprob=_lp(chosen.logprob) if chosen is not None else MIN_LOGPROB,
                                bytes=list(token.encode("utf-8")), top_logprobs=tops))
    return out


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Runs `work` unless the client hangs up first; then `work` is cancelled (its streams abort)
    and None is returned (nobody is left to answer)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server itself gives up on the request (shutdown)
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # let its cleanup (aborting the engine requests) run
    logger.info("client disconnected; request cancelled")
    return None


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error_event(e: Exception, request_id: str) -> str:
    """The SSE error event for a failure after the stream's headers went out (call it from the
    `except` block, so an unexpected error is logged with its traceback)."""
    if isinstance(e, OpenAIError):
        return e.sse()
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"The engine is not running: {e}", 503).sse()
    if isinstance(e, RequestFailedError):
        return OpenAIError(f"The request failed in the engine: {e}", 500).sse()
    logger.exception("error while streaming %s", request_id)
    return OpenAIError(f"Internal server error: {type(e).__name__}: {e}", 500).sse()
