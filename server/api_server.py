"""The FastAPI app: routes, API-key check, lifespan (engine loop start / drain), error handlers.

`build_app(async_engine, ...)` wires one engine into an app: an `AsyncEngine` (a generative model:
completions and chat) or an `AsyncPoolingEngine` (a pooling model: embeddings, pooling, classify,
score, rerank; server/serving_pooling.py). Both kinds of routes exist on every app; asked of the
wrong kind of model they answer 400, saying what the server does serve. The app's lifespan starts
the engine on uvicorn's event loop and, at shutdown, finishes or aborts what is still running.
Routes under `/v1` need `Authorization: Bearer <api key>` when a key is set; `/health`,
`/version`, `/metrics`, `/tokenize` and `/detokenize` never do (as in vLLM). LoRA adapters are
served as further model names (server/serving_lora.py); `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` exist only while `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is true, as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

import jaxengine
from jaxengine.async_engine import AsyncEngine
from jaxengine.async_pooling import AsyncPoolingEngine
from jaxengine.lora import LoRARequest
from jaxengine.server.errors import OpenAIError, install_error_handlers
from jaxengine.server.limits import BodyGuardMiddleware, ServerLimits
from jaxengine.server.metrics import ServerMetrics
from jaxengine.server.protocol import (ChatCompletionRequest, ClassificationRequest, CompletionRequest,
                                       DetokenizeRequest, DetokenizeResponse, EmbeddingRequest,
                                       LoadLoRAAdapterRequest, ModelCard, ModelList, PoolingRequest,
                                       RerankRequest, ScoreRequest, TokenizeChatRequest, TokenizeRequest,
                                       TokenizeResponse, UnloadLoRAAdapterRequest, VersionResponse)
from jaxengine.server.serving_tools import ToolSettings, template_tools
from jaxengine.server.serving_chat import create_chat_completion, render_messages
from jaxengine.server.serving_common import ServingContext
from jaxengine.server.serving_completion import create_completion
from jaxengine.server.serving_lora import RUNTIME_UPDATING_ENVS, LoRAAdapters, runtime_lora_updating_allowed
from jaxengine.server.serving_pooling import (create_classification, create_embedding, create_pooling,
                                              create_rerank, create_score, refuse_generation)

logger = logging.getLogger(__name__)


class ApiKeyMiddleware:
    """401 for `/v1` routes without `Authorization: Bearer <key>` (constant-time comparison).

    A plain ASGI middleware, not `BaseHTTPMiddleware`, so streaming responses and client
    disconnects pass through untouched.
    """

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):]
            if path.startswith("/v1"):
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected):
                    msg = ("Incorrect API key provided. Send it as 'Authorization: Bearer <key>'." if given else
                           "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
                    response = OpenAIError(msg, 401, code="invalid_api_key").response()
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine | AsyncPoolingEngine, *, served_model_names: list[str] | None = None,
              model_path: str | None = None, api_key: str | None = None, chat_template: str | None = None,
              shutdown_drain_timeout: float = 0.0, exit_requested: Callable[[], bool] | None = None,
              limits: ServerLimits | None = None, metrics_vllm_names: bool = False,
              lora_requests: Sequence[LoRARequest] = (), tool_settings: ToolSettings | None = None) -> FastAPI:
    """An app serving `engine`. The engine loop starts with the app's lifespan.

    `served_model_names`: the names clients may send as `model` (the first is reported);
    default: the model path, or "SmolLM2-135M-Instruct" for the embedded default model.
    `exit_requested`: polled while serving (uvicorn's `should_exit`); once true, in-flight requests
    get `shutdown_drain_timeout` seconds to finish and the rest are aborted, so that their
    clients get a proper last chunk (finish_reason "abort") instead of a cut connection.
    `limits`: body size, queue length and per-request limits (default: `ServerLimits()`).
    `metrics_vllm_names`: `/metrics` also exposes every metric under vLLM's `vllm:` name.
    `lora_requests`: LoRA adapters already added to the engine (`serving_lora.load_lora_modules`),
    served under their names. `tool_settings`: `--enable-auto-tool-choice`, `--tool-call-parser` and
    `--reasoning-parser` (a ValueError if auto tool choice is on and no parser can be picked from
    the chat template). The runtime load/unload routes are added when
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (or `JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING`) is true now.
    """
    limits = limits or ServerLimits()
    llm_engine = engine.engine
    names = list(served_model_names or [default_served_name(model_path or llm_engine.config.model)])
    pooling = isinstance(engine, AsyncPoolingEngine)
    max_model_len = int(llm_engine.max_model_len if pooling else llm_engine.config.max_model_len)
    lora = LoRAAdapters(engine, names, lora_requests, max_model_len)
    tokenizer = None if pooling else llm_engine.tokenizer
    tools = (tool_settings or ToolSettings()).resolved(chat_template or getattr(tokenizer, "chat_template", None))
    ctx = ServingContext(engine=engine, model_names=names, model_path=model_path or llm_engine.config.model,
                         max_model_len=max_model_len, chat_template=chat_template, limits=limits, lora=lora,
                         tools=tools)
    metrics = ServerMetrics(names[0], max_model_len, engine.stats, vllm_names=metrics_vllm_names)
    if engine.observer is None:
        engine.observer = metrics

    async def drain_on_exit(poll: Callable[[], bool]) -> None:
        while not poll():
            await asyncio.sleep(0.1)
        logger.info("shutting down: %d request(s) in flight get up to %.1f s to finish",
                    engine.num_open_requests, shutdown_drain_timeout)
        await engine.shutdown(shutdown_drain_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        watcher = asyncio.create_task(drain_on_exit(exit_requested)) if exit_requested else None
        try:
            yield
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()
            await engine.shutdown(shutdown_drain_timeout)

    app = FastAPI(title="jaxengine OpenAI-compatible server", version=jaxengine.__version__, lifespan=lifespan)
    app.state.ctx = ctx
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodyGuardMiddleware, limits=limits)
    if api_key:  # added last, so it runs first: unauthenticated bodies are never read
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            reason = engine.error or "not running"
            return OpenAIError(f"The engine is not running: {reason}", 503).response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=jaxengine.__version__)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=ctx.model_path or name, max_model_len=max_model_len)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card(n) for n in names] + lora.cards())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        name = ctx.resolve_model(model_id)
        adapter = ctx.lora_request(name)
        return lora.card(adapter) if adapter is not None else card(name)

    if runtime_lora_updating_allowed():
        logger.warning("runtime LoRA updating is on (%s): any client may load adapters from this machine's "
                       "folders through /v1/load_lora_adapter", " or ".join(RUNTIME_UPDATING_ENVS))

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
            return await lora.load(req.lora_name, req.lora_path)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
            return await lora.unload(req.lora_name)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        refuse_generation(ctx, req.model, "/v1/completions")
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        refuse_generation(ctx, req.model, "/v1/chat/completions")
        return await create_chat_completion(ctx, req, raw)

    # Pooling (vLLM's routes); a generative model answers 400 (serving_pooling.pooling_engine).
    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        return await create_embedding(ctx, req, raw)

    @app.post("/pooling")
    async def pooling_route(req: PoolingRequest, raw: Request) -> Response:
        return await create_pooling(ctx, req, raw)

    @app.post("/classify")
    async def classify(req: ClassificationRequest, raw: Request) -> Response:
        return await create_classification(ctx, req, raw)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(req: ScoreRequest, raw: Request) -> Response:
        return await create_score(ctx, req, raw)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(req: RerankRequest, raw: Request) -> Response:
        return await create_rerank(ctx, req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        ctx.resolve_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            text, ids = render_messages(ctx, req.messages, req.add_generation_prompt, req.continue_final_message,
                                        req.chat_template_kwargs, template_tools(req))
            if req.add_special_tokens:
                ids = ctx.tokenize(text, add_special_tokens=True)
        else:
            ids = ctx.tokenize(req.prompt, req.add_special_tokens)
        strs = ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        ctx.resolve_model(req.model)
        vocab = llm_engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token ids out of vocabulary [0, {vocab}): {bad[:5]}", 400, param="tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens))

    return app


def default_served_name(model: str | None) -> str:
    """vLLM reports the model argument as given; the embedded default gets its own name."""
    return model if model else "SmolLM2-135M-Instruct"
