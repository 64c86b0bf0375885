"""The gateway's view of its instances: polls each one's /internal/state and feeds the
conductor (load reports, KV events, up/down).

An instance is down until its first good answer, and goes down when it refuses connections
or misses `max_misses` polls in a row; down, its blocks leave the index. When it answers
again it rejoins, and a new boot id (a restarted process) resynchronises its blocks from a
snapshot. With a shared pool configured, every block an instance stores is also credited to
the pool pseudo-instance (write-through: computed blocks are saved to the pool).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpool.conductor.conductor import Conductor
from kvpool.conductor.index import POOL
from kvpool.conductor.records import InstanceLoad
from kvpool.core.retention import Retention

LOAD_FIELDS = tuple(InstanceLoad.__dataclass_fields__)  # what an instance reports, as the simulator's
INFO_FIELDS = ("model", "namespace", "block_size", "max_model_len", "vocab_size", "system_fingerprint")

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Member:
    """One instance as the gateway knows it. `role` is what the gateway uses it for."""

    instance_id: str
    url: str
    role: str  # prefill | decode | both
    up: bool = False
    boot_id: str | None = None
    cursor: int = 0
    misses: int = 0
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    load: dict[str, int] = field(default_factory=dict)
    last_ok: float | None = None

    @property
    def indexed(self) -> bool:
        """Only instances that prefill are routing candidates, so only they enter the index."""
        return self.role in ("prefill", "both")

    def view(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "up": self.up, "error": self.error,
                "load": self.load, "boot_id": self.boot_id, "last_ok": self.last_ok}


class MemberPoller:
    """Polls every member each `interval_s`; all conductor calls happen on the event loop."""

    def __init__(self, members: dict[str, Member], conductor: Conductor, client: httpx.AsyncClient,
                 interval_s: float = 0.1, timeout_s: float = 5.0, max_misses: int = 3) -> None:
        self.members = members
        self.conductor = conductor
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_misses = max_misses
        self.namespace: str | None = None
        self.max_model_len: int | None = None
        self.vocab_size: int | None = None
        self.fingerprint: str | None = None  # the instances' system_fingerprint
        self.pool: str | None = None
        for m in members.values():
            conductor.mark_down(m.instance_id)

    async def run(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self.interval_s)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(m) for m in self.members.values()))

    async def poll(self, m: Member) -> None:
        try:
            r = await self.client.get(f"{m.url}/internal/state", params={"since": m.cursor},
                                      timeout=self.timeout_s)
            r.raise_for_status()
            data = r.json()
        except (httpx.HTTPError, ValueError) as e:
            self.missed(m, e)
            return
        if data.get("boot_id") != m.boot_id and m.cursor:
            # a restarted process: its old blocks are gone and its cursor starts over
            self.conductor.index.on_instance_down(m.instance_id)
            m.boot_id, m.cursor = None, 0
            await self.poll(m)
            return
        self.apply(m, data)

    def missed(self, m: Member, error: Exception) -> None:
        """A failed poll (or a failed forward): refused connections count at once."""
        m.misses += 1
        m.error = f"{type(error).__name__}: {error}"
        if m.up and (isinstance(error, httpx.ConnectError) or m.misses >= self.max_misses):
            logger.warning("instance %s (%s) is down: %s", m.instance_id, m.url, m.error)
            m.up = False
            m.cursor = 0
            self.conductor.mark_down(m.instance_id)

    def apply(self, m: Member, data: dict[str, Any]) -> None:
        problem = self._mismatch(m, data)
        if problem:
            m.error = problem
            if m.up:
                m.up = False
                self.conductor.mark_down(m.instance_id)
            return
        index = self.conductor.index
        stored = [bytes.fromhex(h) for h in data["stored"]]
        evicted = [bytes.fromhex(h) for h in data["evicted"]]
        if m.indexed:
            if data["snapshot"]:
                index.on_instance_down(m.instance_id)
            index.on_stored(m.instance_id, stored)
            index.on_retention(m.instance_id, retention_of(data.get("retention") or {}, time.monotonic()))
            index.on_evicted(m.instance_id, evicted)
        if data.get("kv_remote"):
            self.pool = data["kv_remote"]
            index.on_stored(POOL, stored)
        load = data["load"]
        self.conductor.update_load(m.instance_id, InstanceLoad(**{f: load[f] for f in LOAD_FIELDS}))
        m.load, m.info = load, {k: data[k] for k in INFO_FIELDS}
        m.boot_id, m.cursor, m.misses, m.error, m.last_ok = data["boot_id"], data["cursor"], 0, None, time.time()
        if not m.up:
            logger.info("instance %s (%s) is up", m.instance_id, m.url)
            m.up = True
            self.conductor.mark_up(m.instance_id)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """The smallest KV pool, in tokens, of the instances that decode (a request's output
        lives there); None before any has reported."""
        sizes = [m.load["total_kv_blocks"] for m in self.members.values() if m.role != "prefill" and m.load]
        return min(sizes) * self.conductor.config.block_size if sizes else None

    def _mismatch(self, m: Member, data: dict[str, Any]) -> str | None:
        """Why this instance cannot serve with the others (None when it can)."""
        want = self.conductor.config.block_size
        if data["block_size"] != want:
            return f"block size {data['block_size']} != the conductor's {want} (--block-size)"
        if m.role != "both" and data["role"] not in (m.role, "both"):
            return f"instance serves role {data['role']!r}, configured as {m.role!r}"
        if self.namespace is None:
            self.namespace, self.max_model_len = data["namespace"], data["max_model_len"]
            self.vocab_size, self.fingerprint = data["vocab_size"], data["system_fingerprint"]
        elif data["namespace"] != self.namespace:
            return f"model namespace {data['namespace']!r} != the cluster's {self.namespace!r}"
        return None


def retention_of(wire: dict[str, Any], now: float) -> dict[bytes, Retention | None]:
    """An instance's reported retentions (hex hash -> `{"ttl_s", "priority"}` or null; see
    serve/internal.py) as the index keeps them, in this process's clock from `now`."""
    return {bytes.fromhex(h): None if r is None else _retention(r["ttl_s"], r["priority"], now)
            for h, r in wire.items()}


def _retention(ttl_s: float | None, priority: int, now: float) -> Retention:
    return Retention(math.inf if ttl_s is None else now + ttl_s, priority)
