"""The FastAPI app: OpenAI routes under /v1 (behind the API key when one is set), plus health,
metrics, tokenizer and cache-control routes."""

from __future__ import annotations

import logging
import secrets
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpool.serve.chat import create_chat_completion, render
from kvpool.serve.completions import create_completion
from kvpool.serve.errors import Unauthenticated, install_handlers
from kvpool.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvpool.serve.state import ServerState

logger = logging.getLogger(__name__)


def build_app(state: ServerState, shutdown_timeout_s: float = 30.0) -> FastAPI:
    """An app around a not-yet-started AsyncEngine; its lifespan starts and drains the engine thread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.engine.start()
        yield
        await state.engine.shutdown(shutdown_timeout_s)

    app = FastAPI(title="kvpool", lifespan=lifespan)
    app.state.kvpool = state
    install_handlers(app)

    def require_key(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), state.api_key):
            raise Unauthenticated("missing or invalid API key (send Authorization: Bearer <key>)")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @v1.get("/models")
    async def models() -> dict:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvpool",
                "root": state.model_name, "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(state, req, raw)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(state, req, raw)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.engine.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        req.check()
        state.check_model(req.model)
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
            tokens = render(state, chat)
        else:
            tokens = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        state.check_model(req.model)
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        evicted = await state.engine.call(lambda engine: engine.scheduler.kv.reset_prefix_cache())
        return JSONResponse({"evicted_blocks": evicted})

    return app
