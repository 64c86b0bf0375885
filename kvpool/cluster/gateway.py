"""`kvpool conductor`: an OpenAI-compatible gateway in front of prefill/decode (or colocated)
instances, routing with the pure `Conductor`.

It tokenizes (tokenizer only, no weights, off the event loop), hashes the prompt's full blocks
with the instances' namespace and the tenant's salt, asks the conductor for a (prefill,
decode) pair, and relays the request (`kvpool.cluster.relay`) with the cluster key. A poller
keeps the conductor's loads, KV index and up/down state current. Requests are validated, keyed
and mapped to errors exactly as `kvpool serve` does it (`kvpool.serve.protocol`, `.auth`,
`.errors`, `.gate`): rejections are 429 with Retry-After, an instance failing mid-request is a
502, no instance of a needed role up is a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict

from kvpool.cluster.members import Member, MemberPoller
from kvpool.cluster.metrics import build_registry
from kvpool.cluster.relay import NoInstance, Piece, Relay, RelayStats
from kvpool.conductor.conductor import Conductor
from kvpool.conductor.predictor import StepTimePredictor
from kvpool.conductor.records import ConductorConfig
from kvpool.core.hashing import hash_blocks
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.serve.auth import KeyRing, request_salt
from kvpool.serve.chat import render_request
from kvpool.serve.errors import install_handlers
from kvpool.serve.gate import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, KeyGate, QuietDisconnect
from kvpool.serve.protocol import ChatCompletionRequest, CompletionRequest, check_text
from kvpool.serve.responses import sse_stream, unless_disconnected
from kvpool.serve.sampling_map import set_controls
from kvpool.serve.state import off_loop, tokenizer_pool
from kvpool.serve.tools import ToolPlan

OPEN_ROUTES = frozenset({"/health"})  # plus /metrics with --metrics-open

# request fields passed through to the instances as they are
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
           "min_tokens", "include_stop_str_in_output", "skip_special_tokens")


@dataclass(slots=True)
class GatewayConfig:
    """`prefill`/`decode` URLs for a disaggregated cluster, or `instances` for colocated ones."""

    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    served_model_name: str | None = None
    poll_interval_s: float = 0.1
    api_keys: list[str] = field(default_factory=list)
    cluster_key: str | None = None  # sent to the instances' /internal routes
    metrics_open: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

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
    model_config = ConfigDict(strict=True, extra="forbid")
    prompt: str | list[int]
    cache_salt: str | None = None
    cache_scope: Literal["tenant", "shared"] = "tenant"


def _check_supported(n: int, beam: bool, logprobs: bool, controls: list[str] | None = None) -> None:
    if controls:  # penalties, biases, constraints, best_of: not relayed (a split run would apply them twice)
        raise InvalidRequest(f"the conductor does not relay {controls[0]}", controls[0])
    if n != 1:
        raise InvalidRequest("the conductor serves n=1 only", "n")
    if beam:
        raise InvalidRequest("the conductor does not relay beam search", "use_beam_search")
    if logprobs:
        raise InvalidRequest("the conductor does not relay logprobs or echo", "logprobs")


def _completion_piece(p: Piece) -> dict[str, Any]:
    return {"index": 0, "text": p.text, "logprobs": None, "finish_reason": p.finish_reason,
            "stop_reason": p.stop_reason}


def _completion_whole(text: str, last: Piece) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason,
            "stop_reason": last.stop_reason}


def _chat_piece(p: Piece) -> dict[str, Any]:
    return {"index": 0, "delta": {"content": p.text} if p.text else {}, "logprobs": None,
            "finish_reason": p.finish_reason, "stop_reason": p.stop_reason}


def _chat_whole(text: str, last: Piece) -> dict[str, Any]:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": last.finish_reason, "stop_reason": last.stop_reason}


class Gateway:
    """The gateway's state and its route handlers (registered by `build_gateway`)."""

    def __init__(self, config: GatewayConfig, predictor: StepTimePredictor, tokenizer: Any) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.keys = KeyRing.build(config.api_keys, None, config.metrics_open)
        self.members = config.members()
        prefill_ids = [m.instance_id for m in self.members.values() if m.role in ("prefill", "both")]
        self.decode_ids = [m.instance_id for m in self.members.values() if m.role == "decode"]
        self.conductor = Conductor(prefill_ids, self.decode_ids, predictor, config.conductor)
        headers = {"Authorization": f"Bearer {config.cluster_key}"} if config.cluster_key else {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), headers=headers,
                                        limits=httpx.Limits(max_connections=None))
        self.poller = MemberPoller(self.members, self.conductor, self.client, config.poll_interval_s)
        self.stats = RelayStats()
        self.registry = build_registry(self.poller, self.conductor, self.stats)
        self.pool = tokenizer_pool()
        self.created = int(time.time())

    @asynccontextmanager
    async def lifespan(self, _: FastAPI):
        task = asyncio.create_task(self.poller.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self.client.aclose()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers --------------------------------------------------------------------------
    def model_name(self) -> str:
        return self.config.served_model_name or next(
            (m.info["model"] for m in self.members.values() if m.info), "kvpool")

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name():
            raise InvalidRequest(f"model {model!r} does not exist; this cluster serves {self.model_name()!r}",
                                 "model")

    def hashes(self, ids: list[int], salt: str | None) -> list[bytes]:
        if self.poller.namespace is None:
            raise NoInstance("no instance has reported yet; retry later")
        return hash_blocks(ids, self.config.conductor.block_size, self.poller.namespace, salt)

    def relay_for(self, ids: list[int], req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                  salt: str | None, prefix: str) -> Relay:
        limit = self.poller.max_model_len or 0
        if max_tokens is None:
            max_tokens = max(1, limit - len(ids))
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if limit and len(ids) + max_tokens > limit:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                 f"model's context of {limit}", "max_tokens")
        given = req.model_dump(exclude_unset=True)
        body = {k: given[k] for k in _PASSED if k in given}
        if salt is not None:
            body["cache_salt"] = salt
        rid = f"{prefix}-{uuid.uuid4().hex[:20]}"
        return Relay(rid, ids, self.hashes(ids, salt), body, max_tokens, self.conductor, self.poller, self.client,
                     self.stats)

    @staticmethod
    def usage(relay: Relay) -> dict[str, Any]:
        return {"prompt_tokens": len(relay.ids), "completion_tokens": relay.output_tokens,
                "total_tokens": len(relay.ids) + relay.output_tokens,
                "prompt_tokens_details": {"cached_tokens": relay.cached_tokens}}

    async def respond(self, relay: Relay, raw: Request, stream: bool, include_usage: bool, obj: str,
                      shape: Callable[[Piece], dict[str, Any]], whole: Callable[[str, Piece], dict[str, Any]]):
        first = await relay.start()
        head = {"id": relay.rid, "created": int(time.time()), "model": self.model_name()}
        if stream:
            async def chunks() -> AsyncIterator[dict[str, Any]]:
                if obj == "chat.completion.chunk":
                    yield {**head, "object": obj, "choices": [{"index": 0, "delta": {"role": "assistant",
                           "content": ""}, "logprobs": None, "finish_reason": None}]}
                yield {**head, "object": obj, "choices": [shape(first)]}
                async for piece in relay.rest():
                    yield {**head, "object": obj, "choices": [shape(piece)]}
                if include_usage:
                    yield {**head, "object": obj, "choices": [], "usage": self.usage(relay)}

            return StreamingResponse(sse_stream(chunks()), media_type="text/event-stream")

        async def collect() -> list[Piece]:
            return [first] + [p async for p in relay.rest()]

        pieces = await unless_disconnected(raw, collect())
        text = "".join(p.text for p in pieces)
        return JSONResponse({**head, "object": obj, "choices": [whole(text, pieces[-1])],
                             "usage": self.usage(relay)})

    # -- routes ---------------------------------------------------------------------------
    async def list_models(self) -> dict:
        card = {"id": self.model_name(), "object": "model", "created": self.created, "owned_by": "kvpool",
                "max_model_len": self.poller.max_model_len}
        return {"object": "list", "data": [card]}

    async def completions(self, req: CompletionRequest, raw: Request):
        req.check()
        self.check_model(req.model)
        _check_supported(req.n, req.use_beam_search, req.logprobs is not None or req.echo, set_controls(req))
        prompts = req.prompt_list()
        if len(prompts) != 1:
            raise InvalidRequest("the conductor takes one prompt per request", "prompt")
        p = prompts[0]
        ids = await off_loop(self.pool, self.tokenizer.encode, p, add_special_tokens=req.add_special_tokens) \
            if isinstance(p, str) else list(p)
        relay = self.relay_for(ids, req, req.max_tokens, request_salt(raw, req.cache_salt, req.cache_scope), "cmpl")
        return await self.respond(relay, raw, req.stream, req.include_usage, "text_completion",
                                  _completion_piece, _completion_whole)

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request):
        req.check()
        self.check_model(req.model)
        _check_supported(req.n, req.use_beam_search, req.logprobs, set_controls(req))
        plan = ToolPlan.of(req.tools, req.tool_choice, req.parallel_tool_calls, None)
        if plan.mode != "none":  # a forced call is a constraint, parsing "auto" calls is the server's
            raise InvalidRequest("the conductor does not relay tool calls", "tools")
        ids = await off_loop(self.pool, render_request, self.tokenizer, req, plan)
        salt = request_salt(raw, req.cache_salt, req.cache_scope)
        relay = self.relay_for(ids, req, req.requested_max_tokens, salt, "chatcmpl")
        obj = "chat.completion.chunk" if req.stream else "chat.completion"
        return await self.respond(relay, raw, req.stream, req.include_usage, obj, _chat_piece, _chat_whole)

    async def health(self) -> Response:
        roles = {m.role for m in self.members.values() if m.up}
        ok = bool(roles & {"prefill", "both"}) and (not self.decode_ids or "decode" in roles)
        return Response(status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def cluster(self) -> dict:
        snap = self.conductor.snapshot(time.monotonic())
        for inst, view in snap["instances"].items():
            view.update(self.members[inst].view())
        s = self.stats
        snap["pool"] = self.poller.pool
        snap["gateway"] = {
            "requests": s.requests, "completed": s.completed, "rejected": dict(s.rejected),
            "decode_refused": s.decode_refused, "failed": dict(s.failed), "aborted": s.aborted,
            "prompt_tokens": s.prompt_tokens, "cached_prompt_tokens": s.cached_prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "mean_ttft_s": s.ttft_sum_s / s.ttft_count if s.ttft_count else None,
        }
        return snap

    async def match(self, req: MatchRequest, raw: Request) -> dict:
        """Which instances hold how many leading blocks of this prompt (debugging, tests)."""
        check_text(req.prompt, "prompt")
        if isinstance(req.prompt, str):
            ids = await off_loop(self.pool, self.tokenizer.encode, req.prompt)
        else:
            ids = req.prompt
        h = self.hashes(ids, request_salt(raw, req.cache_salt, req.cache_scope))
        return {"blocks": len(h), "holders": self.conductor.index.prefix_match(h)}


def build_gateway(config: GatewayConfig, predictor: StepTimePredictor, tokenizer: Any) -> FastAPI:
    gw = Gateway(config, predictor, tokenizer)
    app = FastAPI(title="kvpool conductor", lifespan=gw.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    install_handlers(app)
    app.add_api_route("/health", gw.health, methods=["GET"])
    app.add_api_route("/metrics", gw.metrics, methods=["GET"], dependencies=[Depends(gw.keys.metrics)])
    keyed = APIRouter(dependencies=[Depends(gw.keys.api_key)])
    keyed.add_api_route("/v1/models", gw.list_models, methods=["GET"])
    keyed.add_api_route("/v1/completions", gw.completions, methods=["POST"])
    keyed.add_api_route("/v1/chat/completions", gw.chat_completions, methods=["POST"])
    keyed.add_api_route("/cluster", gw.cluster, methods=["GET"])
    keyed.add_api_route("/cluster/match", gw.match, methods=["POST"])
    app.include_router(keyed)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    open_paths = OPEN_ROUTES | {"/metrics"} if config.metrics_open else OPEN_ROUTES
    app.add_middleware(KeyGate, keys=gw.keys, open_paths=open_paths)  # 401 before routing: no path enumeration
    app.add_middleware(QuietDisconnect)
    return app
