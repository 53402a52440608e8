"""`use_beam_search: true` (vLLM's extra) on completions and chat completions: beam search with `n`
beams (`AsyncEngine.beam_search`, which awaits one batch of one-token requests per step and blocks
nobody), answered with the n best sequences as n choices, best first. Not streamed (vLLM does not
stream beam search either): `stream: true` is a 400, and so is any sampling field beam search does
not use (top_p, seed, stop, logprobs, ...), rather than being silently ignored."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from jaxengine.beam_search import BeamSearchOutput, PromptIds
from jaxengine.sampling_params import BeamSearchParams
from jaxengine.server.structured_request import request_constraint
from jaxengine.server.errors import OpenAIError, from_value_error
from jaxengine.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                       CompletionChoice, CompletionRequest, CompletionResponse, SamplingFields)
from jaxengine.server.serving_common import ServingContext, check_capacity, until_disconnected, usage

# Fields beam search does not use -> the values that mean "unset" besides None and False.
_UNUSED: dict[str, tuple[object, ...]] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,), "seed": (), "stop": ([],), "stop_token_ids": ([],), "min_tokens": (0,),
    "logprobs": (), "top_logprobs": (), "prompt_logprobs": (), "echo": ()}


def beam_params(req: SamplingFields, max_tokens: int) -> BeamSearchParams:
    """The request's `BeamSearchParams` (n is the beam width); 400 for what beam search cannot do."""
    if req.stream:
        raise OpenAIError("use_beam_search cannot be streamed: set stream to false.", 400, param="stream")
    unused = [name for name, neutral in _UNUSED.items()
              if (v := getattr(req, name, None)) is not None and v is not False and v not in neutral]
    constraint = request_constraint(req)
    if constraint is not None:
        unused.append(constraint.param)
    if unused:
        raise OpenAIError(f"{', '.join(unused)}: not used by beam search (use_beam_search); leave "
                          f"{'it' if len(unused) == 1 else 'them'} unset.", 400, param=unused[0])
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                temperature=0.0 if req.temperature is None else req.temperature,
                                length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as e:
        error = from_value_error(e, {"max_tokens", "temperature", "length_penalty"})
        if str(e).startswith("beam_width"):  # the request calls it n
            error = OpenAIError(f"n (the beam width with use_beam_search): {e}", 400, param="n")
        raise error from e


async def _search(ctx: ServingContext, request_id: str, prompts: list[PromptIds], params: BeamSearchParams,
                  raw: Request, model: str) -> list[BeamSearchOutput] | None:
    """The search (with `model`'s LoRA adapter, if it names one), or None if the client left
    (its requests are aborted)."""
    check_capacity(ctx, len(prompts) * params.beam_width)
    try:
        return await until_disconnected(raw, ctx.engine.beam_search(prompts, params, request_id,
                                                                    ctx.lora_request(model)))
    except ValueError as e:
        raise from_value_error(e, {"max_tokens", "n", "prompt"}) from e


async def beam_completion(ctx: ServingContext, req: CompletionRequest, raw: Request, model: str,
                          prompts: list[PromptIds]) -> Response:
    """Choice index = prompt index * n + rank, as for sampled completions."""
    max_tokens = req.max_tokens if req.max_tokens is not None else ctx.max_model_len - max(len(p[1]) for p in prompts)
    params = beam_params(req, max_tokens)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    results = await _search(ctx, request_id, prompts, params, raw, model)
    if results is None:
        return Response(status_code=499)
    choices = [CompletionChoice(index=i * req.n + j, text=s.output_text or "", finish_reason=s.finish_reason,
                                stop_reason=s.stop_reason)
               for i, out in enumerate(results) for j, s in enumerate(out.sequences)]
    generated = sum(s.num_generated_tokens for out in results for s in out.sequences)
    resp = CompletionResponse(id=request_id, model=model, choices=choices,
                              usage=usage(sum(len(ids) for _, ids in prompts), generated))
    return Response(resp.model_dump_json(), media_type="application/json")


async def beam_chat(ctx: ServingContext, req: ChatCompletionRequest, raw: Request, model: str,
                    prompt: PromptIds) -> Response:
    max_tokens = req.max_new_tokens if req.max_new_tokens is not None else ctx.max_model_len - len(prompt[1])
    params = beam_params(req, max_tokens)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    results = await _search(ctx, request_id, [prompt], params, raw, model)
    if results is None:
        return Response(status_code=499)
    [out] = results
    choices = [ChatChoice(index=j, message=AssistantMessage(content=s.output_text or ""),
                          finish_reason=s.finish_reason, stop_reason=s.stop_reason)
               for j, s in enumerate(out.sequences)]
    resp = ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=usage(len(prompt[1]), sum(s.num_generated_tokens for s in out.sequences)))
    return Response(resp.model_dump_json(), media_type="application/json")
