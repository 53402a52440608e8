"""The pooling endpoints, with vLLM's shapes: `/v1/embeddings` (OpenAI's), `/pooling`,
`/classify`, `/score` and `/rerank`.

One request: the handler resolves the model name (404), checks that the server runs a pooling
model that supports the task (400 otherwise, saying what the server does serve), turns the body
into prompts and `PoolingParams` (400 naming the field), awaits the `AsyncPoolingEngine` (which
runs it on its worker thread, see jaxengine/async_pooling.py) and shapes the outputs. Results
equal `LLM.embed / encode / classify / score` on the same model: both call the same
`PoolingEngine` methods.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Awaitable, Sequence
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxengine.async_pooling import AsyncPoolingEngine
from jaxengine.outputs import PoolingRequestOutput
from jaxengine.pooling import PromptInput
from jaxengine.pooling_params import PoolingParams
from jaxengine.server.errors import OpenAIError, from_value_error
from jaxengine.server.protocol import (ClassificationData, ClassificationRequest, ClassificationResponse,
                                       EmbeddingData, EmbeddingRequest, EmbeddingResponse, PoolingData,
                                       PoolingRequest, PoolingResponse, PoolingUsage, RerankDocument,
                                       RerankRequest, RerankResponse, RerankResult, RerankUsage, ScoreData,
                                       ScoreRequest, ScoreResponse)
from jaxengine.server.serving_common import ServingContext, check_capacity, until_disconnected

POOLING_PARAM_NAMES = {"dimensions", "normalize", "truncate_prompt_tokens", "activation"}
POOLING_ENDPOINTS = "/v1/embeddings, /pooling, /classify, /score and /rerank"
GENERATIVE_ENDPOINTS = "/v1/completions and /v1/chat/completions"


# -- which engine serves what -------------------------------------------------------------------
def _architecture(ctx: ServingContext) -> str:
    return str(getattr(ctx.engine.engine.model_config, "architecture", "") or "this model")


def pooling_engine(ctx: ServingContext, model: str, endpoint: str, task: str) -> AsyncPoolingEngine:
    """The server's pooling engine if its model supports `task`; else a 400 that says why."""
    engine = ctx.engine
    if not isinstance(engine, AsyncPoolingEngine):
        raise OpenAIError(f"The model `{model}` ({_architecture(ctx)}) is a generative model: {endpoint} needs an "
                          "embedding, classification or cross-encoder model, served with `jaxengine serve MODEL "
                          f"--runner pooling`. This server serves {GENERATIVE_ENDPOINTS}.", 400, param="model",
                          code="model_not_supported")
    if task not in engine.engine.supported_tasks():
        raise OpenAIError(f"The model `{model}` ({_architecture(ctx)}) does not support {endpoint} (task {task!r}); "
                          f"it supports {', '.join(engine.engine.supported_tasks())}.", 400, param="model",
                          code="model_not_supported")
    return engine


def refuse_generation(ctx: ServingContext, model: str | None, endpoint: str) -> None:
    """A 400 for a generation endpoint when the server runs a pooling model."""
    if isinstance(ctx.engine, AsyncPoolingEngine):
        name = ctx.resolve_model(model)
        tasks = ", ".join(ctx.engine.engine.supported_tasks())
        raise OpenAIError(f"The model `{name}` ({_architecture(ctx)}) is a pooling model ({tasks}): it does not "
                          f"generate text, so {endpoint} is not served. Use {POOLING_ENDPOINTS}.", 400,
                          param="model", code="model_not_supported")


# -- inputs ---------------------------------------------------------------------------------------
def _prompts(ctx: ServingContext, value: str | list, param: str) -> list[PromptInput]:
    """A text, texts, token ids or lists of token ids -> one prompt each."""
    if isinstance(value, str):
        value = [value]
    elif value and isinstance(value[0], int):
        value = [value]
    if not value:
        raise OpenAIError(f"{param} must not be empty.", 400, param=param)
    if len(value) > ctx.limits.max_prompts_per_request:
        raise OpenAIError(f"{param} holds {len(value)} inputs; at most {ctx.limits.max_prompts_per_request} are "
                          "allowed per request.", 400, param=param)
    if any(not p for p in value):
        raise OpenAIError(f"{param} must not contain an empty string or an empty token list.", 400, param=param)
    return list(value)


def _params(param: str, **kw: object) -> PoolingParams:
    try:
        return PoolingParams(**kw)
    except ValueError as e:
        raise _bad_input(e, param) from e


def _bad_input(e: ValueError, param: str) -> OpenAIError:
    """An engine `ValueError` as a 400 naming the field: a parameter its message starts with,
    else the input field (too long, empty, out of vocabulary, unpaired texts)."""
    err = from_value_error(e, POOLING_PARAM_NAMES)
    if err.param is None:
        err.param = param
    return err


async def _run(ctx: ServingContext, raw: Request, work: Awaitable[list[PoolingRequestOutput]],
               param: str) -> list[PoolingRequestOutput] | None:
    """Runs `work` unless the client hangs up (then None); engine input errors -> 400."""
    check_capacity(ctx, 1)
    try:
        return await until_disconnected(raw, work)
    except ValueError as e:
        raise _bad_input(e, param) from e


def _usage(outs: Sequence[PoolingRequestOutput]) -> PoolingUsage:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return PoolingUsage(prompt_tokens=n, total_tokens=n)


def _encoded(vector: Sequence[float] | np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vector, dtype=np.float32).tolist() if isinstance(vector, np.ndarray) else list(vector)


def _gone() -> Response:
    return Response(status_code=499)  # the client disconnected: nobody reads this


# -- endpoints ---------------------------------------------------------------------------------
async def create_embedding(ctx: ServingContext, req: EmbeddingRequest, raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    engine = pooling_engine(ctx, model, "/v1/embeddings", "embed")
    prompts = _prompts(ctx, req.input, "input")
    params = _params("input", normalize=req.normalize, dimensions=req.dimensions,
                     truncate_prompt_tokens=req.truncate_prompt_tokens, task="embed")
    outs = await _run(ctx, raw, engine.embed(prompts, params), "input")
    if outs is None:
        return _gone()
    data = [EmbeddingData(index=i, embedding=_encoded(o.outputs.embedding, req.encoding_format))
            for i, o in enumerate(outs)]
    body = EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", model=model, data=data, usage=_usage(outs))
    return JSONResponse(body.model_dump())


async def create_pooling(ctx: ServingContext, req: PoolingRequest, raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    engine = pooling_engine(ctx, model, "/pooling", "encode")
    prompts = _prompts(ctx, req.input, "input")
    params = _params("input", normalize=req.normalize, dimensions=req.dimensions,
                     truncate_prompt_tokens=req.truncate_prompt_tokens, task="encode")
    outs = await _run(ctx, raw, engine.encode(prompts, params), "input")
    if outs is None:
        return _gone()
    data = [PoolingData(index=i, data=_encoded(o.outputs.data, req.encoding_format)) for i, o in enumerate(outs)]
    body = PoolingResponse(id=f"pool-{uuid.uuid4().hex}", model=model, data=data, usage=_usage(outs))
    return JSONResponse(body.model_dump())


async def create_classification(ctx: ServingContext, req: ClassificationRequest, raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    engine = pooling_engine(ctx, model, "/classify", "classify")
    prompts = _prompts(ctx, req.input, "input")
    params = _params("input", activation=req.activation, truncate_prompt_tokens=req.truncate_prompt_tokens,
                     task="classify")
    outs = await _run(ctx, raw, engine.classify(prompts, params), "input")
    if outs is None:
        return _gone()
    labels = engine.engine.model_config.id2label
    data = []
    for i, o in enumerate(outs):
        probs = o.outputs.probs
        best = int(np.argmax(probs))
        data.append(ClassificationData(index=i, label=labels[best] if best < len(labels) else None, probs=probs,
                                       num_classes=len(probs)))
    body = ClassificationResponse(id=f"classify-{uuid.uuid4().hex}", model=model, data=data, usage=_usage(outs))
    return JSONResponse(body.model_dump())


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise OpenAIError(f"{param} must not be empty.", 400, param=param)
    return texts


async def create_score(ctx: ServingContext, req: ScoreRequest, raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    engine = pooling_engine(ctx, model, raw.url.path, "score")
    left, right = _texts(req.text_1, "text_1"), _texts(req.text_2, "text_2")
    if len(left) != 1 and len(left) != len(right):
        raise OpenAIError(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1 for many text_2, "
                          "or as many of each.", 400, param="text_2")
    if len(right) > ctx.limits.max_prompts_per_request:
        raise OpenAIError(f"text_2 holds {len(right)} texts; at most {ctx.limits.max_prompts_per_request} are "
                          "allowed per request.", 400, param="text_2")
    params = _params("text_1", activation=req.activation, truncate_prompt_tokens=req.truncate_prompt_tokens,
                     task="score")
    outs = await _run(ctx, raw, engine.score(left, right, params), "text_1")
    if outs is None:
        return _gone()
    data = [ScoreData(index=i, score=o.outputs.score) for i, o in enumerate(outs)]
    body = ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=model, data=data, usage=_usage(outs))
    return JSONResponse(body.model_dump())


async def create_rerank(ctx: ServingContext, req: RerankRequest, raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    engine = pooling_engine(ctx, model, raw.url.path, "score")
    docs = _texts(req.documents, "documents")
    if len(docs) > ctx.limits.max_prompts_per_request:
        raise OpenAIError(f"documents holds {len(docs)} texts; at most {ctx.limits.max_prompts_per_request} are "
                          "allowed per request.", 400, param="documents")
    if req.top_n is not None and req.top_n < 0:
        raise OpenAIError(f"top_n must be at least 0 (0: every document), got {req.top_n}.", 400, param="top_n")
    params = _params("documents", activation=req.activation, truncate_prompt_tokens=req.truncate_prompt_tokens,
                     task="score")
    outs = await _run(ctx, raw, engine.score(req.query, docs, params), "documents")
    if outs is None:
        return _gone()
    order = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)  # stable: ties keep input order
    keep = order[:req.top_n] if req.top_n else order
    results = [RerankResult(index=i, relevance_score=outs[i].outputs.score,
                            document=RerankDocument(text=docs[i]) if req.return_documents else None) for i in keep]
    usage = RerankUsage(total_tokens=sum(len(o.prompt_token_ids) for o in outs))
    body = RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, usage=usage, results=results)
    return JSONResponse(body.model_dump(exclude_none=True))
