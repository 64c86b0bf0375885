"""Cluster-wide pins: `POST /v1/kv/pin` and `POST /v1/kv/unpin` on `kvpool conductor`.

The body is the instances' (`PinRequest`, serve/retention_routes.py) and so is the scope: the
conductor's `--admin-api-key` acts in any namespace through `cache_salt`, a tenant's key in its
own only (its salt joined with `cache_salt`, as its requests are hashed). The gateway tokenizes,
scopes the salt and sends the full blocks' token ids with that salt to every instance that is
up, whatever its role (a pin holds by content, so the prefix stays wherever a request is
prefilled or decoded later), with the cluster key, each within `timeout_s`. The answer names
each instance's result and each failure; a 502 only when none took it (then nothing is kept).

The conductor keeps the pins (`PinBook`) and, every poll interval, sends an instance what it is
owed: the pins it has not taken at its current boot id (it was down, restarted or timed out:
a joining instance gets the cluster's pins) with the TTL left, and the unpins it missed. A pin
or unpin is in the book before it is sent, and all pin traffic to one instance goes through
one lock (a replay holds it from reading the book to its last answer), so a replay never
lands after the unpin or pin that replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import Executor
from typing import Any, Protocol

import httpx
from fastapi import Depends, FastAPI

from kvpool.cluster.members import Member, MemberPoller
from kvpool.cluster.relay import InstanceFailed, NoInstance
from kvpool.conductor.pins import ClusterUnpin, PinBook
from kvpool.core.retention import MAX_TTL_S
from kvpool.engine.input_processor import check_token_ids
from kvpool.errors import InvalidRequest
from kvpool.serve.auth import KeyRing, Tenant, effective_salt
from kvpool.serve.retention_fields import parse_priority, parse_ttl
from kvpool.serve.retention_routes import PinRequest
from kvpool.serve.state import off_loop


class Gateway(Protocol):
    """What the pin routes use of `kvpool.cluster.gateway.Gateway`, which installs them (a
    protocol, so this module does not import the gateway back)."""

    members: dict[str, Member]
    poller: MemberPoller
    pool: Executor
    tokenizer: Any
    config: Any  # GatewayConfig: conductor.block_size, poll_interval_s
    client: httpx.AsyncClient
    keys: KeyRing

    def check_model(self, model: str | None) -> None: ...

    def hashes(self, ids: list[int], salt: str | None) -> list[bytes]: ...

RETRY_S = 2.0  # after a failed replay, the next try on that instance

logger = logging.getLogger(__name__)

Answers = dict[str, dict[str, Any]]


class ClusterPins:
    """The routes' work, the fan-out and the replays, over the gateway's members and client."""

    def __init__(self, gw: Gateway, book: PinBook, timeout_s: float) -> None:
        self.gw, self.book, self.timeout_s = gw, book, timeout_s
        self._locks = {i: asyncio.Lock() for i in gw.members}
        self._retry_at: dict[str, float] = {}

    # -- the routes -------------------------------------------------------------------------
    async def pin(self, req: PinRequest, tenant: Tenant | None) -> dict[str, Any]:
        ttl = None if req.ttl is None else parse_ttl(req.ttl, "ttl", MAX_TTL_S)
        priority = parse_priority(req.priority, "priority")
        ids, salt, hashes, prompt_tokens = await self._prefix(req, tenant)
        until = math.inf if ttl is None else time.monotonic() + ttl
        record, before = self.book.pin(hashes[-1], hashes[0], ids, salt, until, priority)
        try:
            answers, failed, took = await self._fan_out("pin", _pin_body(ids, salt, ttl, priority))
        except InstanceFailed:
            self.book.undo_pin(record, before)
            raise
        if (record.until, record.priority) == (until, priority):  # else each is owed the merge
            for inst, boot in took.items():
                self.book.confirm(record, inst, boot)
        return {"instances": {i: {"pinned_blocks": a["pinned_blocks"], "device_pinned_blocks":
                                  a["device_pinned_blocks"]} for i, a in answers.items()},
                "failed": failed, "prompt_tokens": prompt_tokens, "ttl_seconds": ttl, "priority": priority,
                "scope": _scope(tenant)}

    async def unpin(self, req: PinRequest, tenant: Tenant | None) -> dict[str, Any]:
        if req.ttl is not None or req.priority != 0:
            raise InvalidRequest("unpin takes no ttl or priority", param="ttl" if req.ttl is not None else "priority")
        ids, salt, hashes, _ = await self._prefix(req, tenant)
        boots = {m.instance_id: m.boot_id for m in self.gw.members.values() if m.boot_id is not None}
        dropped, record = self.book.unpin(hashes[0], ids, salt, boots)
        try:
            answers, failed, took = await self._fan_out("unpin", {"prompt": list(ids), "cache_salt": salt})
        except InstanceFailed:
            self.book.undo_unpin(dropped, record)
            raise
        for inst, boot in took.items():
            self.book.confirm(record, inst, boot)
        return {"instances": {i: {"unpinned_blocks": a["unpinned_blocks"]} for i, a in answers.items()},
                "failed": failed, "cluster_pins_dropped": len(dropped), "scope": _scope(tenant)}

    async def _prefix(self, req: PinRequest, tenant: Tenant | None) -> tuple[tuple[int, ...], str | None,
                                                                             list[bytes], int]:
        """The token ids of the full blocks the request covers, the scoped salt, their hashes
        and the prompt's length; a prefix without a full block is a 400."""
        gw = self.gw
        gw.check_model(req.model)
        if gw.poller.namespace is None:
            raise NoInstance("no instance has reported yet; retry later")
        if isinstance(req.prompt, str):
            ids = await off_loop(gw.pool, gw.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            check_token_ids(req.prompt, gw.poller.vocab_size, "prompt")
            ids = list(req.prompt)
        if req.cache_salt is not None and "\x00" in req.cache_salt:
            raise InvalidRequest("cache_salt may not contain NUL characters", param="cache_salt")
        block = gw.config.conductor.block_size
        n = len(ids) if req.prefix_tokens is None else min(req.prefix_tokens, len(ids))
        covered = tuple(ids[:n - n % block])
        if not covered:
            param = "prompt" if req.prefix_tokens is None or req.prefix_tokens >= len(ids) else "prefix_tokens"
            raise InvalidRequest(f"{param}: {n} tokens hold no full block of {block}: nothing to pin", param=param)
        salt = effective_salt(tenant, req.cache_salt, "tenant")
        return covered, salt, gw.hashes(list(covered), salt), len(ids)

    # -- to the instances -------------------------------------------------------------------
    async def _fan_out(self, op: str, body: dict[str, Any]) -> tuple[Answers, dict[str, str], dict[str, str]]:
        """Send to every member at once: (answers, failures by instance, boot ids of those that
        took it). None took it: a 502 naming every failure."""
        members = list(self.gw.members.values())
        results = await asyncio.gather(*(self._one(m, op, body) for m in members))
        answers, failed, took = {}, {}, {}
        for m, (answer, boot, error) in zip(members, results, strict=True):
            if error is None:
                answers[m.instance_id], took[m.instance_id] = answer, boot
            else:
                failed[m.instance_id] = error
        if not answers:
            raise InstanceFailed(f"no instance took the {op}: " + "; ".join(f"{i}: {e}" for i, e in failed.items()))
        return answers, failed, took

    async def _one(self, m: Member, op: str, body: dict[str, Any]) -> tuple[dict[str, Any], str, str | None]:
        """(answer, boot id, None), or ({}, "", why not)."""
        boot = m.boot_id
        if not m.up or boot is None:
            return {}, "", f"down (owed: sent when it is back): {m.error or 'not reported yet'}"
        try:
            async with asyncio.timeout(self.timeout_s), self._locks[m.instance_id]:
                return await self._send(m, op, body), boot, None
        except TimeoutError:
            return {}, "", f"no answer within {self.timeout_s:g}s"
        except InstanceFailed as e:
            return {}, "", str(e)

    async def _send(self, m: Member, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/kv/{op} to one instance (the caller holds its lock), within `timeout_s`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                r = await self.gw.client.post(f"{m.url}/v1/kv/{op}", json=body)
        except TimeoutError:
            raise InstanceFailed(f"no answer within {self.timeout_s:g}s") from None
        except httpx.HTTPError as e:
            if isinstance(e, httpx.TransportError):
                self.gw.poller.missed(m, e)
            raise InstanceFailed(f"{type(e).__name__}: {e}") from e
        try:
            data = r.json()
        except ValueError:
            data = {}
        if r.status_code != 200:
            message = data.get("error", {}).get("message") if isinstance(data, dict) else None
            raise InstanceFailed(f"HTTP {r.status_code}: {message or r.text[:200]}")
        return data

    # -- replays ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Every poll interval, send each up instance what it is owed."""
        while True:
            await asyncio.sleep(self.gw.config.poll_interval_s)
            await self.settle(time.monotonic())

    async def settle(self, now: float) -> None:
        """Replay to each up instance that is owed something and not busy with pin traffic."""
        await asyncio.gather(*(self._replay(m) for m in self.gw.members.values()
                               if m.up and m.boot_id is not None and self._retry_at.get(m.instance_id, 0.0) <= now
                               and not self._locks[m.instance_id].locked()))

    async def _replay(self, m: Member) -> None:
        async with self._locks[m.instance_id]:
            boot = m.boot_id
            if boot is not None:
                await self._send_owed(m, boot)

    async def _send_owed(self, m: Member, boot: str) -> None:
        for op in self.book.owed(m.instance_id, boot, time.monotonic()):
            if isinstance(op, ClusterUnpin):
                kind, body = "unpin", {"prompt": list(op.ids), "cache_salt": op.salt}
            else:
                left = op.ttl_left(time.monotonic())
                if left is not None and left <= 0:
                    continue
                kind, body = "pin", _pin_body(op.ids, op.salt, left, op.priority)
            try:
                await self._send(m, kind, body)
            except InstanceFailed as e:
                logger.warning("instance %s: replaying a cluster %s failed (retry in %gs): %s",
                               m.instance_id, kind, RETRY_S, e)
                self._retry_at[m.instance_id] = time.monotonic() + RETRY_S
                return
            self.book.confirm(op, m.instance_id, boot)


def _pin_body(ids: tuple[int, ...], salt: str | None, ttl_s: float | None, priority: int) -> dict[str, Any]:
    """An instance's pin body: the TTL in whole seconds, rounded up (a replay's is what is left)."""
    ttl = None if ttl_s is None else f"{max(1, math.ceil(ttl_s))}s"
    return {"prompt": list(ids), "ttl": ttl, "priority": priority, "cache_salt": salt}


def _scope(tenant: Tenant | None) -> str:
    return "server" if tenant is None else "tenant"


def install_pins(app: FastAPI, gw: Gateway, book: PinBook, timeout_s: float) -> ClusterPins:
    """The two routes behind the admin scope (registered outside the API-key router: the admin
    key is no tenant's); the caller runs `ClusterPins.run` for the replays."""
    pins = ClusterPins(gw, book, timeout_s)

    @app.post("/v1/kv/pin")
    async def pin(req: PinRequest, tenant: Tenant | None = Depends(gw.keys.admin_scope)) -> dict[str, Any]:  # noqa: B008
        return await pins.pin(req, tenant)

    @app.post("/v1/kv/unpin")
    async def unpin(req: PinRequest, tenant: Tenant | None = Depends(gw.keys.admin_scope)) -> dict[str, Any]:  # noqa: B008
        return await pins.unpin(req, tenant)

    return pins
