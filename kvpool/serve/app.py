"""The FastAPI app: OpenAI routes under /v1, tokenizer and cache-control routes, all behind the
API key (`kvpool.serve.auth`); `/health` and `/ping` are open, `/metrics` open only with `--metrics-open`.
No OpenAPI or docs routes (they would describe the server to anyone)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpool.serve import front
from kvpool.serve.auth import Tenant
from kvpool.serve.chat import create_chat_completion, render
from kvpool.serve.completions import create_completion
from kvpool.serve.errors import ModelNotFound, install_handlers
from kvpool.serve.gate import (
    DEFAULT_MAX_REQUEST_BYTES,
    BodyLimit,
    DrainGate,
    KeyGate,
    QuietDisconnect,
)
from kvpool.serve.http_metrics import HTTPMetricsMiddleware
from kvpool.serve.lora_routes import adapter_card, adapter_cards
from kvpool.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvpool.serve.responses_api import create_response
from kvpool.serve.responses_protocol import ResponsesRequest
from kvpool.serve.retention_routes import install_retention
from kvpool.serve.state import ServerState
from kvpool.version import __version__

logger = logging.getLogger(__name__)

OPEN_ROUTES = frozenset({"/health", "/ping"})  # plus /metrics with --metrics-open; every other route needs the key


def build_app(state: ServerState, shutdown_timeout_s: float = 30.0,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """An app around a not-yet-started AsyncEngine; its lifespan starts and drains the engine thread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.engine.start()
        yield
        await state.engine.shutdown(shutdown_timeout_s)
        state.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvpool", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvpool = state
    install_handlers(app)
    keys = state.keys

    @app.get("/health")
    async def health() -> Response:
        problem = "the server is shutting down" if state.engine.draining else state.engine.health()
        if problem is None:
            return Response(status_code=200)
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)

    # vLLM's (and SageMaker's) name for /health: probes send no key, and it tells nothing more
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/metrics", dependencies=[Depends(keys.metrics)])
    async def metrics() -> Response:
        return Response(generate_latest(state.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models() -> dict:
        names = state.served_names or (state.model_name,)
        listing = front.model_list(names, state.model_name, state.created, state.max_model_len)
        listing["data"] += adapter_cards(state)  # LoRA adapters, each with its parent (vLLM's shape)
        return listing

    @v1.get("/models/{model_id:path}")
    async def model_card(model_id: str) -> dict:
        if not model_id:
            raise ModelNotFound("give a model id: GET /v1/models/{id}", param="model")
        if state.check_model(model_id) is not None:  # 404 model_not_found for a name this server does not serve
            return adapter_card(state, model_id)
        return front.model_card(model_id, state.model_name, state.created, state.max_model_len)

    @v1.post("/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        return await create_response(state, req, raw)

    @v1.post("/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(state, req, raw)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(state, req, raw)

    tools = APIRouter()

    @tools.get("/version")
    async def version() -> dict:
        return {"version": __version__}  # behind the key: a version tells an attacker which bugs to try

    @tools.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        req.check()
        state.check_model(req.model)
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            tokens = await state.off_loop(render, state.tokenizer, req.messages, req.add_generation_prompt,
                                          req.chat_template_kwargs, False, tools)
        else:
            tokens = await state.off_loop(state.tokenizer.encode, req.prompt,
                                          add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}

    @tools.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        req.check(state.vocab_size)
        state.check_model(req.model)
        return {"prompt": await state.off_loop(state.tokenizer.decode, req.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(tenant: Tenant | None = Depends(keys.admin_scope)) -> JSONResponse:  # noqa: B008
        """A tenant's key evicts its own namespace's idle blocks (and counts only those); the admin
        key, or a server without keys, evicts every idle block."""
        owned = None if tenant is None else tenant.owns
        evicted = await state.engine.call(lambda engine: engine.scheduler.kv.reset_prefix_cache(owned))
        return JSONResponse({"evicted_blocks": evicted, "scope": "server" if tenant is None else "tenant"})

    install_retention(app, state)  # POST /v1/kv/pin, /v1/kv/unpin (same scope) and the retention metrics

    app.include_router(v1, dependencies=[Depends(keys.api_key)])
    app.include_router(tools, dependencies=[Depends(keys.api_key)])
    app.add_middleware(DrainGate, draining=lambda: state.engine.draining, passthrough=frozenset({"/metrics"}))
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    open_paths = OPEN_ROUTES | {"/metrics"} if keys.metrics_open else OPEN_ROUTES
    app.add_middleware(KeyGate, keys=keys, open_paths=open_paths)  # before the body: none read without a key
    app.add_middleware(QuietDisconnect)
    app.add_middleware(HTTPMetricsMiddleware, metrics=state.engine.metrics.http)  # outermost: counts refusals too
    return app
