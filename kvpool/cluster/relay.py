"""One request through the cluster: route it, run its prefill, then its decode, and keep the
conductor's bookkeeping in step with what really happened.

Disaggregated: the prefill instance gets the prompt with max_tokens=1 (its blocks reach the
shared pool); the decode instance gets prompt + first token with max_tokens-1, loads the
prompt's KV from the pool and streams the rest. Colocated (`both`): one call does all.
`start()` returns the first token, having already opened the decode stream, so every refusal
or failure before the first byte becomes a proper HTTP status; `rest()` streams the others.
Each piece carries its tokens' logprobs when asked for (the first token's from the prefill
instance that sampled it); the prompt's logprobs come from the prefill instance alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpool.cluster.members import Member, MemberPoller
from kvpool.conductor.conductor import Conductor
from kvpool.conductor.records import RouteRequest
from kvpool.engine.outputs import CompletionOutput
from kvpool.errors import InvalidRequest, KVPoolError, Overloaded
from kvpool.serve.errors import NoUpstream, UpstreamFailed


class InstanceFailed(UpstreamFailed):
    """An instance failed while serving the request (HTTP 502)."""


class NoInstance(NoUpstream):
    """No instance of a needed role is up (HTTP 503)."""


class _Refused(KVPoolError):
    """The instance answered with an error status before streaming."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        error = body.get("error", {})
        super().__init__(error.get("message", f"HTTP {status}"))
        self.status, self.param = status, error.get("param")


def _pairs(tops: list[list[list[Any]] | None] | None) -> list[list[tuple[int, float]] | None] | None:
    """Top-N lists from JSON, their (token id, logprob) pairs back to tuples as the engine gives them."""
    return None if tops is None else [None if top is None else [(int(t), v) for t, v in top] for top in tops]


@dataclass(slots=True)
class Piece:
    """New tokens from an instance, with their logprobs (and top-N) when the request asked."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @classmethod
    def of(cls, data: dict[str, Any]) -> Piece:
        """A /internal/generate line."""
        return cls(data["token_ids"], data["text"], data["finish_reason"], data["stop_reason"], data.get("logprobs"),
                   _pairs(data.get("top_logprobs")))

    @classmethod
    def join(cls, pieces: list[Piece]) -> Piece:
        """Consecutive pieces as one (their tokens, text and logprobs in order; the last's end)."""
        out = cls([], "", pieces[-1].finish_reason, pieces[-1].stop_reason)
        for p in pieces:
            out.token_ids += p.token_ids
            out.text += p.text
            if p.logprobs is not None:
                out.logprobs = (out.logprobs or []) + p.logprobs
                out.top_logprobs = (out.top_logprobs or []) + (p.top_logprobs or [])
        return out

    def output(self) -> CompletionOutput:
        """As the engine's output record, for the front's logprobs shapes."""
        return CompletionOutput(0, self.token_ids, self.text, self.finish_reason, self.stop_reason,
                                logprobs=self.logprobs, top_logprobs=self.top_logprobs)


@dataclass(slots=True)
class PromptLogprobs:
    """The prompt's logprobs from the prefill instance (the fields `vllm_prompt_logprobs` reads)."""

    prompt_token_ids: list[int]
    prompt_logprobs: list[float | None]
    prompt_top_logprobs: list[list[tuple[int, float]] | None]


@dataclass(slots=True)
class RelayStats:
    """The gateway's own counters (the conductor keeps the routing ones)."""

    requests: int = 0
    completed: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    decode_refused: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    aborted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0


class _Upstream:
    """An open NDJSON stream from /internal/generate."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.lines = response.aiter_lines()

    @classmethod
    async def open(cls, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> _Upstream:
        req = client.build_request("POST", f"{url}/internal/generate", json=body)
        response = await client.send(req, stream=True)
        if response.status_code != 200:
            raw = await response.aread()
            await response.aclose()
            try:
                detail = json.loads(raw)
            except ValueError:
                detail = {}
            raise _Refused(response.status_code, detail if isinstance(detail, dict) else {})
        return cls(response)

    async def next(self) -> dict[str, Any] | None:
        async for line in self.lines:
            if line:
                data = json.loads(line)
                if "error" in data:
                    raise KVPoolError(data["error"].get("message", "instance error"))
                return data
        return None

    async def close(self) -> None:
        await self.response.aclose()


ROUTES = 3  # routes a request may take before its first token when connections are lost


class Relay:
    def __init__(self, rid: str, ids: list[int], hashes: list[bytes], body: dict[str, Any], max_tokens: int,
                 conductor: Conductor, poller: MemberPoller, client: httpx.AsyncClient, stats: RelayStats) -> None:
        self.rid, self.ids, self.hashes, self.body, self.max_tokens = rid, ids, hashes, body, max_tokens
        self.conductor, self.poller, self.client, self.stats = conductor, poller, client, stats
        self.arrival = time.monotonic()
        self.cached_tokens = 0
        self.kv_breakdown: dict[str, dict[str, int]] = {}  # the prefill's, as `kvpool serve` reports it
        self.output_tokens = 0
        self.prompt_logprobs: PromptLogprobs | None = None  # with the body's prompt_logprobs
        self._stream: _Upstream | None = None
        self._stream_member: Member | None = None
        self._routed = False
        self._first_done = False
        self._failed = False
        self._connection_lost = False  # the last failure was the connection's, not an instance's answer
        self._counted = False  # the first token is in the stats

    # -- the first token ------------------------------------------------------------------
    async def start(self) -> Piece:
        """Route the request and return its first token. Until then nothing has reached the
        client, so a lost connection (an instance killed since the last poll: refused, or a
        pooled connection it dropped) routes the request again, up to `ROUTES` times; the poller
        has counted the miss (a refused connection marks the instance down at once)."""
        self.stats.requests += 1
        for _ in range(ROUTES - 1):
            try:
                return await self._route_and_open()
            except InstanceFailed:
                if not self._connection_lost:
                    raise
            self._failed = self._connection_lost = self._first_done = False  # the next route's first token
            self.output_tokens = 0
        return await self._route_and_open()

    async def _route_and_open(self) -> Piece:
        members = self.poller.members
        if not any(m.up and m.indexed for m in members.values()):
            raise NoInstance("no prefill instance is up; retry later")
        if any(m.role == "decode" for m in members.values()) and not any(
                m.up and m.role == "decode" for m in members.values()):
            raise NoInstance("no decode instance is up; retry later")
        # max_tokens 0 (score the prompt) is routed as a 1-token request; the prefill ends it
        d = self.conductor.route(RouteRequest(self.rid, len(self.ids), self.hashes, max(1, self.max_tokens)),
                                 time.monotonic())
        if not d.accepted:
            self.stats.rejected[d.reason] = self.stats.rejected.get(d.reason, 0) + 1
            raise Overloaded(f"the cluster refused the request ({d.reason}: predicted TTFT "
                             f"{d.predicted_ttft:.2f}s); retry later", retry_after_s=1.0)
        self._routed = True
        prefill, decode = members[d.prefill_id], members[d.decode_id]
        try:
            if prefill is decode:
                first = await self._open(prefill, self.ids, self.max_tokens, self.body.get("min_tokens", 0))
            else:
                first = await self._prefill_then_open_decode(prefill, decode)
        except BaseException:
            await self.close()
            raise
        return first

    async def _prefill_then_open_decode(self, prefill: Member, decode: Member) -> Piece:
        min_tokens = self.body.get("min_tokens", 0)
        pieces = [await self._open(prefill, self.ids, min(self.max_tokens, 1), min(min_tokens, 1))]
        while pieces[-1].finish_reason is None:  # drain the one-token stream
            more = await self._next()
            if more is None:
                break
            pieces.append(more)
        await self._close_stream()
        first = Piece.join(pieces)
        if first.finish_reason != "length" or self.max_tokens <= 1:
            self._finish()
            return first
        first.finish_reason = None
        first.stop_reason = None
        try:
            await self._open(decode, self.ids + first.token_ids, self.max_tokens - 1, max(0, min_tokens - 1),
                             first_token=False)
        except Overloaded:
            self.stats.decode_refused += 1
            self.conductor.on_rejected_after_prefill(self.rid, len(self.ids) - self.cached_tokens)
            self._routed = False
            raise
        return first

    async def _open(self, member: Member, prompt: list[int], max_tokens: int, min_tokens: int,
                    first_token: bool = True) -> Piece:
        """Open a generation stream on `member`; with `first_token`, read and return it. The
        prompt's logprobs are asked of the instance that computes the prompt, not of the decode."""
        body = {**self.body, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": min_tokens}
        if not first_token:
            body.pop("prompt_logprobs", None)
        self._stream_member = member
        try:
            self._stream = await _Upstream.open(self.client, member.url, body)
        except _Refused as e:
            if e.status == 429:
                raise Overloaded(f"instance {member.instance_id} refused the request: {e}") from e
            if e.status == 400:
                raise InvalidRequest(str(e), param=e.param) from e  # the instance's own words
            raise self._failure(member, e) from e
        except httpx.HTTPError as e:
            raise self._failure(member, e) from e
        if not first_token:
            return Piece([], "")
        piece = await self._next()
        if piece is None:
            raise self._failure(member, KVPoolError("the stream ended before the first token"))
        return piece

    def _failure(self, member: Member, error: Exception) -> InstanceFailed:
        self._failed = True
        self._connection_lost = isinstance(error, httpx.TransportError)
        self.stats.failed[member.instance_id] = self.stats.failed.get(member.instance_id, 0) + 1
        if isinstance(error, httpx.TransportError):
            self.poller.missed(member, error)
        return InstanceFailed(f"instance {member.instance_id} ({member.role} at {member.url}) failed "
                              f"while serving this request: {type(error).__name__}: {error}")

    async def _next(self) -> Piece | None:
        assert self._stream is not None and self._stream_member is not None
        try:
            data = await self._stream.next()
        except (httpx.HTTPError, KVPoolError) as e:
            raise self._failure(self._stream_member, e) from e
        if data is None:
            return None
        if not self._first_done:
            self._first_done = True
            self.cached_tokens = data["num_cached_tokens"]
            self.kv_breakdown = data.get("kv_breakdown", {})
            if data.get("prompt_logprobs") is not None:
                self.prompt_logprobs = PromptLogprobs(self.ids, data["prompt_logprobs"],
                                                      _pairs(data.get("prompt_top_logprobs")) or [])
            now = time.monotonic()
            if not self._counted:  # once per request, though a second route reads its first token again
                self._counted = True
                self.stats.prompt_tokens += len(self.ids)
                self.stats.cached_prompt_tokens += self.cached_tokens
                self.stats.ttft_sum_s += now - self.arrival
                self.stats.ttft_count += 1
            self.conductor.on_prefill_done(self.rid, now)
        self.output_tokens += len(data["token_ids"])
        self.stats.generated_tokens += len(data["token_ids"])
        piece = Piece.of(data)
        if piece.finish_reason is not None and self._stream_member.role != "prefill":
            self._finish()
        return piece

    # -- the rest -------------------------------------------------------------------------
    async def rest(self) -> AsyncIterator[Piece]:
        try:
            while self._stream is not None:
                piece = await self._next()
                if piece is None:
                    if self._routed:
                        raise self._failure(self._stream_member, KVPoolError("the stream ended early"))
                    break
                yield piece
                if piece.finish_reason is not None:
                    break
        finally:
            await self.close()

    def _finish(self) -> None:
        if self._routed:
            self._routed = False
            self.stats.completed += 1
            self.conductor.on_decode_done(self.rid, time.monotonic(), output_tokens=max(1, self.output_tokens))

    async def _close_stream(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None

    async def close(self) -> None:
        """Release the upstream stream; a request that did not finish leaves the conductor's books
        as failed (instance failure or client gone)."""
        await self._close_stream()
        if self._routed:
            self._routed = False
            if not self._failed:
                self.stats.aborted += 1
            self.conductor.on_failed(self.rid)
