"""`kvpool conductor`: an OpenAI-compatible gateway in front of prefill/decode (or colocated)
instances, routing with the pure `Conductor`.

It tokenizes (tokenizer only, no weights), hashes the prompt's full blocks with the instances'
namespace, asks the conductor for a (prefill, decode) pair, and relays the request
(`kvpool.cluster.relay`). A poller keeps the conductor's loads, KV index and up/down state
current. Rejections are 429 with Retry-After; an instance failing mid-request is a 502; no
instance of a needed role up is a 503 — all in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from kvpool.cluster.conductor import Conductor
from kvpool.cluster.members import Member, MemberPoller
from kvpool.cluster.metrics import build_registry
from kvpool.cluster.predictor import StepTimePredictor
from kvpool.cluster.records import ConductorConfig
from kvpool.cluster.relay import InstanceFailed, NoInstance, Piece, Relay, RelayStats
from kvpool.core.hashing import hash_blocks
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.serve.errors import Unauthenticated, error_body, install_handlers
from kvpool.serve.protocol import ChatCompletionRequest, CompletionRequest
from kvpool.serve.responses import sse_stream, unless_disconnected

# request fields passed through to the instances as they are
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
           "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "cache_salt")


@dataclass(slots=True)
class GatewayConfig:
    """`prefill`/`decode` URLs for a disaggregated cluster, or `instances` for colocated ones."""

    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    served_model_name: str | None = None
    poll_interval_s: float = 0.1
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.instances and (self.prefill or self.decode):
            raise ConfigError("give either --instances (colocated) or --prefill and --decode, not both")
        if not self.instances and not (self.prefill and self.decode):
            raise ConfigError("a disaggregated cluster needs at least one --prefill and one --decode URL")

    def members(self) -> dict[str, Member]:
        out: dict[str, Member] = {}
        for prefix, role, urls in (("p", "prefill", self.prefill), ("d", "decode", self.decode),
                                   ("i", "both", self.instances)):
            for i, url in enumerate(urls):
                out[f"{prefix}{i}"] = Member(f"{prefix}{i}", url.rstrip("/"), role)
        return out


class MatchRequest(BaseModel):
    prompt: str | list[int]
    cache_salt: str | None = None


def build_gateway(config: GatewayConfig, predictor: StepTimePredictor, tokenizer: Any) -> FastAPI:
    members = config.members()
    prefill_ids = [m.instance_id for m in members.values() if m.role in ("prefill", "both")]
    decode_ids = [m.instance_id for m in members.values() if m.role == "decode"]
    conductor = Conductor(prefill_ids, decode_ids, predictor, config.conductor)
    client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), limits=httpx.Limits(max_connections=None))
    poller = MemberPoller(members, conductor, client, config.poll_interval_s)
    stats = RelayStats()
    registry = build_registry(poller, conductor, stats)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(poller.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose()

    app = FastAPI(title="kvpool conductor", lifespan=lifespan)
    install_handlers(app)
    _install_upstream_handlers(app)

    def model_name() -> str:
        return config.served_model_name or next((m.info["model"] for m in members.values() if m.info), "kvpool")

    def check_model(model: str | None) -> None:
        if model and model != model_name():
            raise InvalidRequest(f"model {model!r} does not exist; this cluster serves {model_name()!r}", "model")

    def require_key(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or token.strip() != config.api_key:
            raise Unauthenticated("missing or invalid API key (send Authorization: Bearer <key>)")

    def hashes(ids: list[int], salt: str | None) -> list[bytes]:
        if poller.namespace is None:
            raise NoInstance("no instance has reported yet; retry later")
        return hash_blocks(ids, config.conductor.block_size, poller.namespace, salt)

    def relay_for(ids: list[int], req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                  prefix: str) -> Relay:
        limit = poller.max_model_len or 0
        if max_tokens is None:
            max_tokens = max(1, limit - len(ids))
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if limit and len(ids) + max_tokens > limit:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                 f"model's context of {limit}", "max_tokens")
        given = req.model_dump(exclude_unset=True)
        body = {k: given[k] for k in _PASSED if k in given}
        rid = f"{prefix}-{uuid.uuid4().hex[:20]}"
        return Relay(rid, ids, hashes(ids, req.cache_salt), body, max_tokens, conductor, poller, client, stats)

    def usage(relay: Relay) -> dict[str, Any]:
        return {"prompt_tokens": len(relay.ids), "completion_tokens": relay.output_tokens,
                "total_tokens": len(relay.ids) + relay.output_tokens,
                "prompt_tokens_details": {"cached_tokens": relay.cached_tokens}}

    async def collect(relay: Relay, first: Piece) -> list[Piece]:
        return [first] + [p async for p in relay.rest()]

    async def respond(relay: Relay, raw: Request, stream: bool, include_usage: bool, obj: str,
                      shape: Callable[[Piece], dict[str, Any]], whole: Callable[[str, Piece], dict[str, Any]]):
        first = await relay.start()
        head = {"id": relay.rid, "created": int(time.time()), "model": model_name()}
        if stream:
            async def chunks() -> AsyncIterator[dict[str, Any]]:
                if obj == "chat.completion.chunk":
                    yield {**head, "object": obj, "choices": [{"index": 0, "delta": {"role": "assistant",
                           "content": ""}, "logprobs": None, "finish_reason": None}]}
                yield {**head, "object": obj, "choices": [shape(first)]}
                async for piece in relay.rest():
                    yield {**head, "object": obj, "choices": [shape(piece)]}
                if include_usage:
                    yield {**head, "object": obj, "choices": [], "usage": usage(relay)}

            return StreamingResponse(sse_stream(chunks()), media_type="text/event-stream")
        pieces = await unless_disconnected(raw, collect(relay, first))
        last = pieces[-1]
        text = "".join(p.text for p in pieces)
        return JSONResponse({**head, "object": obj, "choices": [whole(text, last)], "usage": usage(relay)})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @v1.get("/models")
    async def models() -> dict:
        card = {"id": model_name(), "object": "model", "created": created, "owned_by": "kvpool",
                "max_model_len": poller.max_model_len}
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(req: CompletionRequest, raw: Request):
        req.check()
        check_model(req.model)
        _check_supported(req.n, req.use_beam_search, req.logprobs is not None or req.echo)
        prompts = req.prompt_list()
        if len(prompts) != 1:
            raise InvalidRequest("the conductor takes one prompt per request", "prompt")
        ids = tokenizer.encode(prompts[0]) if isinstance(prompts[0], str) else list(prompts[0])
        relay = relay_for(ids, req, req.max_tokens, "cmpl")
        return await respond(
            relay, raw, req.stream, req.include_usage, "text_completion",
            lambda p: {"index": 0, "text": p.text, "logprobs": None, "finish_reason": p.finish_reason,
                       "stop_reason": p.stop_reason},
            lambda text, last: {"index": 0, "text": text, "logprobs": None,
                                "finish_reason": last.finish_reason, "stop_reason": last.stop_reason})

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        req.check()
        check_model(req.model)
        _check_supported(req.n, req.use_beam_search, req.logprobs)
        text = tokenizer.apply_chat_template([m.as_template_input() for m in req.messages],
                                             add_generation_prompt=req.add_generation_prompt,
                                             **(req.chat_template_kwargs or {}))
        ids = tokenizer.encode(text, add_special_tokens=False)
        relay = relay_for(ids, req, req.requested_max_tokens, "chatcmpl")
        obj = "chat.completion.chunk" if req.stream else "chat.completion"
        return await respond(
            relay, raw, req.stream, req.include_usage, obj,
            lambda p: {"index": 0, "delta": {"content": p.text} if p.text else {}, "logprobs": None,
                       "finish_reason": p.finish_reason, "stop_reason": p.stop_reason},
            lambda text, last: {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                "finish_reason": last.finish_reason, "stop_reason": last.stop_reason})

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        roles = {m.role for m in members.values() if m.up}
        ok = bool(roles & {"prefill", "both"}) and (not decode_ids or "decode" in roles)
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/cluster")
    async def cluster() -> dict:
        snap = conductor.snapshot(time.monotonic())
        for inst, view in snap["instances"].items():
            view.update(members[inst].view())
        s = stats
        snap["pool"] = poller.pool
        snap["gateway"] = {
            "requests": s.requests, "completed": s.completed, "rejected": dict(s.rejected),
            "decode_refused": s.decode_refused, "failed": dict(s.failed), "aborted": s.aborted,
            "prompt_tokens": s.prompt_tokens, "cached_prompt_tokens": s.cached_prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "mean_ttft_s": s.ttft_sum_s / s.ttft_count if s.ttft_count else None,
        }
        return snap

    @app.post("/cluster/match")
    async def match(req: MatchRequest) -> dict:
        """Which instances hold how many leading blocks of this prompt (debugging, tests)."""
        ids = tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
        h = hashes(ids, req.cache_salt)
        return {"blocks": len(h), "holders": conductor.index.prefix_match(h)}

    return app


def _check_supported(n: int, beam: bool, logprobs: bool) -> None:
    if n != 1:
        raise InvalidRequest("the conductor serves n=1 only", "n")
    if beam:
        raise InvalidRequest("the conductor does not relay beam search", "use_beam_search")
    if logprobs:
        raise InvalidRequest("the conductor does not relay logprobs or echo", "logprobs")


def _install_upstream_handlers(app: FastAPI) -> None:
    async def on_failed(_: Request, exc: InstanceFailed) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "upstream_error", None, "instance_failed"), status_code=502)

    async def on_none(_: Request, exc: NoInstance) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "service_unavailable", None, "no_instance"), status_code=503,
                            headers={"Retry-After": "1"})

    app.add_exception_handler(InstanceFailed, on_failed)
    app.add_exception_handler(NoInstance, on_none)
