"""Mooncake Store as a remote KV pool, reached through its master at `mooncake://host:port`.

The client joins the pool with its own memory segment (P2P handshake over TCP, no etcd),
so this process's segment is part of the store while it lives. Quirks handled here:
`put` returns -200 when the pool is full until the master's background eviction frees room
(a failed write, not an outage); `get`/`is_exist` grant a lease during which the object
cannot be removed (delete is best effort); objects are immutable, so racing writers agree.
After an outage the client is rebuilt, since a restarted master has forgotten its segment.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any
from urllib.parse import parse_qs, urlparse

from kvpool.errors import ConfigError
from kvpool.store.health import PoolHealth
from kvpool.store.tier import StoreKey, TierStats

log = logging.getLogger(__name__)

NO_AVAILABLE_HANDLE = -200  # the pool is full right now
OBJECT_HAS_LEASE = -706  # a reader holds a lease; the object cannot be removed yet
_MIB = 1 << 20


class MooncakeTier:
    """`mooncake://host:port[?segment_mb=64&buffer_mb=32&hostname=127.0.0.1]`."""

    def __init__(self, url: str, retry_s: float = 1.0, connect_timeout_s: float = 0.5,
                 name: str = "mooncake") -> None:
        parsed = urlparse(url)
        if parsed.scheme != "mooncake" or not parsed.hostname or not parsed.port:
            raise ConfigError(f"expected mooncake://host:port, got {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        self.name = name
        self.url = url
        self.master = f"{parsed.hostname}:{parsed.port}"
        self.segment_bytes = int(query.get("segment_mb", 64)) * _MIB
        self.buffer_bytes = int(query.get("buffer_mb", 32)) * _MIB
        self.hostname = query.get("hostname", "127.0.0.1")
        self.connect_timeout_s = connect_timeout_s
        self.max_value_bytes: int | None = None
        self._stats = TierStats(name=name, capacity_bytes=self.segment_bytes)
        self.health = PoolHealth(f"{name} ({url})", self._stats, retry_s=retry_s)
        self._lock = threading.Lock()
        self._client: Any = None
        with self._lock:
            self._connect()

    def _connect(self) -> bool:
        """Join the pool; caller holds the lock. False (and marked down) on failure."""
        from mooncake.store import MooncakeDistributedStore  # native library, loaded on use

        host, port = self.master.rsplit(":", 1)
        try:  # setup() against a dead master retries for minutes; fail fast instead
            socket.create_connection((host, int(port)), timeout=self.connect_timeout_s).close()
        except OSError as exc:
            self.health.failed("connect", exc)
            return False
        client = MooncakeDistributedStore()
        rc = client.setup(self.hostname, "P2PHANDSHAKE", self.segment_bytes, self.buffer_bytes,
                          "tcp", "", self.master)
        if rc != 0:
            self.health.failed("setup", f"error {rc}")
            client.close()
            return False
        self._client = client
        return True

    def _ready(self) -> bool:
        """A usable client, rebuilding it after an outage once the back-off has passed."""
        if not self.health.available():
            return False
        return self._client is not None or self._connect()

    def _fail(self, what: str, rc: int) -> None:
        """Mark down and drop the client; closing it can take seconds, so not on this thread."""
        self.health.failed(what, f"error {rc}")
        if self._client is not None:
            threading.Thread(target=self._client.close, name="mooncake-close", daemon=True).start()
            self._client = None

    def contains(self, key: StoreKey) -> bool:
        return self.lookup([key]) == 1

    def lookup(self, keys: list[StoreKey]) -> int:
        if not keys:
            return 0
        with self._lock:
            if not self._ready():
                return 0
            present = self._client.batch_is_exist(keys)
            failed = [rc for rc in present if rc < 0]
            if failed:
                self._fail("lookup", failed[0])
                return 0
            self.health.succeeded()
        for i, hit in enumerate(present):
            if hit != 1:
                return i
        return len(keys)

    def get(self, key: StoreKey) -> bytes | None:
        with self._lock, self._stats.timed_load():
            # An empty result is a miss or an RPC failure; lookup() tells them apart.
            data = self._client.get(key) if self._ready() else b""
            if not data:
                self._stats.misses += 1
                return None
            if self.max_value_bytes is not None and len(data) > self.max_value_bytes:
                self._stats.count_bad("size")
                self._stats.misses += 1
                self._client.remove(key)  # best effort (a lease may hold it a while)
                return None
            self._stats.hits += 1
            self._stats.bytes_read += len(data)
            return bytes(data)

    def put(self, key: StoreKey, data: bytes) -> bool:
        with self._lock, self._stats.timed_store():
            if not self._ready():
                self._stats.failed_puts += 1
                return False
            rc = self._client.put(key, data)
            if rc == 0:
                self.health.succeeded()
                self._stats.puts += 1
                self._stats.bytes_written += len(data)
                return True
            self._stats.failed_puts += 1
            if rc == NO_AVAILABLE_HANDLE:
                log.debug("mooncake tier %s full: put of %d bytes refused", self.name, len(data))
            else:
                self._fail("put", rc)
            return False

    def delete(self, key: StoreKey) -> None:
        with self._lock:
            if self._ready():
                rc = self._client.remove(key)
                if rc not in (0, OBJECT_HAS_LEASE) and rc < 0:
                    log.debug("mooncake tier %s: remove %s returned %d", self.name, key, rc)

    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
