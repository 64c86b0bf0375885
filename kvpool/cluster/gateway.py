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
from collections.abc import AsyncIterator, Callable, Sequence
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
from kvpool.cluster.pins import ClusterPins, install_pins
from kvpool.cluster.relay import NoInstance, Piece, Relay, RelayStats
from kvpool.conductor.conductor import Conductor
from kvpool.conductor.pins import PinBook
from kvpool.conductor.predictor import StepTimePredictor
from kvpool.conductor.records import ConductorConfig
from kvpool.core.hashing import hash_blocks
from kvpool.engine.input_processor import InputLimits, InputProcessor
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.sched.sampling_params import SamplingParams
from kvpool.serve.auth import KeyRing, request_salt
from kvpool.serve.chat import delta_choices, render_request, whole_choice
from kvpool.serve.errors import ModelNotFound, install_handlers
from kvpool.serve.front import (
    check_model,
    completion_choice,
    default_max_tokens,
    model_card,
    model_list,
    response_head,
    role_delta,
    usage_counts,
)
from kvpool.serve.gate import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, KeyGate, QuietDisconnect
from kvpool.serve.protocol import ChatCompletionRequest, CompletionRequest, check_text
from kvpool.serve.responses import (
    chat_logprobs,
    completion_logprobs,
    sse_stream,
    unless_disconnected,
    vllm_prompt_logprobs,
)
from kvpool.serve.retention_fields import chat_marks, chat_retention, completion_retention, relayed
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
    cluster_key: str | None = None  # sent to the instances' /internal and pin routes
    admin_api_key: str | None = None  # cluster pins in any namespace (kvpool.cluster.pins)
    pin_timeout_s: float = 5.0  # per instance, for a pin's fan-out and replays
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


def _check_supported(n: int, beam: bool, echo: bool, controls: list[str] | None = None) -> None:
    if controls:  # penalties, biases, constraints, best_of: not relayed (a split run would apply them twice)
        raise InvalidRequest(f"the conductor does not relay {controls[0]}", controls[0])
    if n != 1:
        raise InvalidRequest("the conductor serves n=1 only", "n")
    if beam:
        raise InvalidRequest("the conductor does not relay beam search", "use_beam_search")
    if echo:
        raise InvalidRequest("the conductor does not relay echo", "echo")


class Gateway:
    """The gateway's state and its route handlers (registered by `build_gateway`)."""

    def __init__(self, config: GatewayConfig, predictor: StepTimePredictor, tokenizer: Any) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.keys = KeyRing.build(config.api_keys, None, config.metrics_open, config.admin_api_key)
        self.members = config.members()
        prefill_ids = [m.instance_id for m in self.members.values() if m.role in ("prefill", "both")]
        self.decode_ids = [m.instance_id for m in self.members.values() if m.role == "decode"]
        self.conductor = Conductor(prefill_ids, self.decode_ids, predictor, config.conductor)
        headers = {"Authorization": f"Bearer {config.cluster_key}"} if config.cluster_key else {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), headers=headers,
                                        limits=httpx.Limits(max_connections=None))
        self.poller = MemberPoller(self.members, self.conductor, self.client, config.poll_interval_s)
        self.stats = RelayStats()
        self.pin_book = PinBook()
        self.pins: ClusterPins | None = None  # set by build_gateway
        self.registry = build_registry(self.poller, self.conductor, self.stats, self.pin_book)
        self.pool = tokenizer_pool()
        self.created = int(time.time())

    @asynccontextmanager
    async def lifespan(self, _: FastAPI):
        tasks = [asyncio.create_task(self.poller.run())]
        if self.pins is not None:
            tasks.append(asyncio.create_task(self.pins.run()))
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.client.aclose()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers --------------------------------------------------------------------------
    def _instance_model(self) -> str | None:
        return next((m.info["model"] for m in self.members.values() if m.info), None)

    def model_name(self) -> str:
        return self.config.served_model_name or self._instance_model() or "kvpool"

    def check_model(self, model: str | None) -> None:
        """As `kvpool serve`: the served name, or the instances' own."""
        check_model(model, self.model_name(), {m.info["model"] for m in self.members.values() if m.info})

    def hashes(self, ids: list[int], salt: str | None) -> list[bytes]:
        if self.poller.namespace is None:
            raise NoInstance("no instance has reported yet; retry later")
        return hash_blocks(ids, self.config.conductor.block_size, self.poller.namespace, salt)

    def params(self, ids: list[int], req: CompletionRequest | ChatCompletionRequest,
               max_tokens: int | None) -> SamplingParams:
        """The request's parameters as an instance would take them: the same default max_tokens
        and the same checks, against the limits the instances report."""
        if self.poller.max_model_len is None:
            raise NoInstance("no instance has reported yet; retry later")
        if max_tokens is None:
            max_tokens = default_max_tokens(len(ids), req.n, self.poller.max_model_len,
                                            self.poller.kv_capacity_tokens)
        limits = InputLimits(self.poller.vocab_size, self.poller.max_model_len)
        logprobs = req.logprobs if isinstance(req, CompletionRequest) else req.num_logprobs
        prompt_logprobs = req.prompt_logprobs if isinstance(req, CompletionRequest) else None
        return InputProcessor(self.tokenizer, limits).process(
            ids, req.sampling_params(max_tokens, logprobs, prompt_logprobs)).params

    def relay_for(self, ids: list[int], req: CompletionRequest | ChatCompletionRequest, params: SamplingParams,
                  salt: str | None, prefix: str) -> Relay:
        """The request for the instances: its passed fields, the logprobs it asks for (the
        prompt's go to the prefill instance only), the tenant's salt."""
        given = req.model_dump(exclude_unset=True)
        body = {k: given[k] for k in _PASSED if k in given}
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) is not None:
                body[name] = getattr(params, name)
        if salt is not None:
            body["cache_salt"] = salt
        if params.retention:
            body["kvpool_retention"] = relayed(params.retention)
        rid = f"{prefix}-{uuid.uuid4().hex[:20]}"
        return Relay(rid, ids, self.hashes(ids, salt), body, params.max_tokens, self.conductor, self.poller,
                     self.client, self.stats)

    @staticmethod
    def usage(relay: Relay) -> dict[str, Any]:
        """As `kvpool serve`'s usage: the counts, and the prefill's KV breakdown."""
        out = usage_counts(len(relay.ids), relay.output_tokens, relay.cached_tokens)
        out["prompt_tokens_details"].update(relay.kv_breakdown)
        return out

    def head(self, relay: Relay) -> dict[str, Any]:
        return response_head(relay.rid, int(time.time()), self.model_name(), self.poller.fingerprint)

    async def whole(self, relay: Relay, raw: Request) -> Piece:
        """A whole (non-streamed) response's pieces as one."""
        first = await relay.start()

        async def collect() -> list[Piece]:
            return [first] + [p async for p in relay.rest()]

        return Piece.join(await unless_disconnected(raw, collect()))

    def prompt_field(self, req: CompletionRequest, relay: Relay) -> dict[str, Any]:
        """vLLM's `prompt_logprobs` of a completion choice, as `kvpool serve` adds it (from the
        instance that computed the prompt)."""
        if req.prompt_logprobs is None or relay.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.tokenizer, relay.prompt_logprobs, req.prompt_logprobs)}

    def completion_chunks(self, req: CompletionRequest, relay: Relay) -> Callable[[Piece], list[dict[str, Any]]]:
        """Each piece as a streamed completion choice: its logprobs with text offsets counted from
        the text sent before it, the prompt's logprobs on the first, as `kvpool serve` streams."""
        sent = -1  # -1 until the first chunk

        def choices(piece: Piece) -> list[dict[str, Any]]:
            nonlocal sent
            first, offset = sent < 0, max(sent, 0)
            sent = offset + len(piece.text)
            lps = completion_logprobs(self.tokenizer, piece.output(), 0, offset)
            return [{**completion_choice(0, piece.text, lps, piece.finish_reason, piece.stop_reason),
                     **(self.prompt_field(req, relay) if first else {})}]

        return choices

    async def stream(self, relay: Relay, include_usage: bool, obj: str,
                     choices: Callable[[Piece], list[dict[str, Any]]], opening: Sequence[dict[str, Any]] = ()):
        """A streamed response: `opening` choices, then each piece's, then the usage."""
        first = await relay.start()  # a refusal or failure before the first token is a status
        head = {**self.head(relay), "object": obj}

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            for choice in opening:
                yield {**head, "choices": [choice]}
            for choice in choices(first):
                yield {**head, "choices": [choice]}
            async for piece in relay.rest():
                for choice in choices(piece):
                    yield {**head, "choices": [choice]}
            if include_usage:
                yield {**head, "choices": [], "usage": self.usage(relay)}

        return StreamingResponse(sse_stream(chunks()), media_type="text/event-stream")

    # -- routes ---------------------------------------------------------------------------
    async def list_models(self) -> dict:
        return model_list((self.model_name(),), self._instance_model() or self.model_name(), self.created,
                          self.poller.max_model_len)

    async def show_model(self, model_id: str) -> dict:
        if not model_id:
            raise ModelNotFound("give a model id: GET /v1/models/{id}", param="model")
        self.check_model(model_id)
        return model_card(model_id, self._instance_model() or self.model_name(), self.created,
                          self.poller.max_model_len)

    async def completions(self, req: CompletionRequest, raw: Request):
        req.check()
        self.check_model(req.model)
        _check_supported(req.n, req.use_beam_search, req.echo, set_controls(req))
        prompts = req.prompt_list()
        if len(prompts) != 1:
            raise InvalidRequest("the conductor takes one prompt per request", "prompt")
        p = prompts[0]
        ids = await off_loop(self.pool, self.tokenizer.encode, p, add_special_tokens=req.add_special_tokens) \
            if isinstance(p, str) else list(p)
        params = self.params(ids, req, req.max_tokens)
        params.retention = completion_retention(req.kvpool_retention, prompts, self.tokenizer, req.add_special_tokens)
        relay = self.relay_for(ids, req, params, request_salt(raw, req.cache_salt, req.cache_scope), "cmpl")
        if req.stream:
            return await self.stream(relay, req.include_usage, "text_completion", self.completion_chunks(req, relay))
        out = await self.whole(relay, raw)
        choice = {**completion_choice(0, out.text, completion_logprobs(self.tokenizer, out.output(), 0, 0),
                                      out.finish_reason, out.stop_reason), **self.prompt_field(req, relay)}
        return JSONResponse({**self.head(relay), "object": "text_completion", "choices": [choice],
                             "usage": self.usage(relay)})

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request):
        req.check()
        self.check_model(req.model)
        _check_supported(req.n, req.use_beam_search, False, set_controls(req))
        plan = ToolPlan.of(req.tools, req.tool_choice, req.parallel_tool_calls, None)
        if plan.mode != "none":  # a forced call is a constraint, parsing "auto" calls is the server's
            raise InvalidRequest("the conductor does not relay tool calls", "tools")
        ids = await off_loop(self.pool, render_request, self.tokenizer, req, plan)
        params = self.params(ids, req, req.requested_max_tokens)
        marks = chat_marks(req.messages)
        if marks:  # as kvpool serve maps them, relayed as kvpool_retention
            kwargs = {**(req.chat_template_kwargs or {}), **({"tools": plan.template_tools} if plan.template_tools else {})}
            params.retention = await off_loop(self.pool, chat_retention, self.tokenizer, req.messages, marks, kwargs,
                                              req.add_generation_prompt, req.add_special_tokens)
        relay = self.relay_for(ids, req, params, request_salt(raw, req.cache_salt, req.cache_scope), "chatcmpl")
        if req.stream:
            calls = plan.stream()
            return await self.stream(relay, req.include_usage, "chat.completion.chunk", lambda piece: delta_choices(
                plan, calls, 0, piece.text, piece.finish_reason is not None,
                chat_logprobs(self.tokenizer, piece.output(), 0), bool(piece.token_ids), piece.finish_reason,
                piece.stop_reason), opening=[role_delta(0)])
        out = await self.whole(relay, raw)
        choice = whole_choice(plan, 0, out.text, chat_logprobs(self.tokenizer, out.output(), 0), out.finish_reason,
                              out.stop_reason)
        return JSONResponse({**self.head(relay), "object": "chat.completion", "choices": [choice],
                             "usage": self.usage(relay)})

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
        snap["cluster_pins"] = len(self.pin_book.pins(time.monotonic()))
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
    keyed.add_api_route("/v1/models/{model_id:path}", gw.show_model, methods=["GET"])
    keyed.add_api_route("/v1/completions", gw.completions, methods=["POST"])
    keyed.add_api_route("/v1/chat/completions", gw.chat_completions, methods=["POST"])
    keyed.add_api_route("/cluster", gw.cluster, methods=["GET"])
    keyed.add_api_route("/cluster/match", gw.match, methods=["POST"])
    app.include_router(keyed)
    gw.pins = install_pins(app, gw, gw.pin_book, config.pin_timeout_s)  # behind the admin scope
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    open_paths = OPEN_ROUTES | {"/metrics"} if config.metrics_open else OPEN_ROUTES
    app.add_middleware(KeyGate, keys=gw.keys, open_paths=open_paths)  # 401 before routing: no path enumeration
    app.add_middleware(QuietDisconnect)
    return app
