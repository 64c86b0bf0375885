"""Mooncake Store as a remote KV pool, reached through its master at `mooncake://host:port`.

The client joins the pool with its own memory segment (P2P handshake over TCP, no etcd),
so this process's segment is part of the store while it lives. Quirks handled here:
`put` returns -200 when the pool is full until the master's background eviction frees room
(a failed write, not an outage); `get`/`is_exist` grant a lease during which the object
cannot be removed (delete is best effort); objects are immutable, so racing writers agree.
After an outage the client is rebuilt, since a restarted master has forgotten its segment.
Layer-wise reads (`get_range`) read byte ranges into a buffer registered with the client.

Retention (issue 32, item 1) is the master's soft pin: its eviction takes unpinned objects first
and soft-pinned ones only when nothing else can go (`--allow_evict_soft_pinned_objects`, default
on). A retained block is written with a soft pin as long as its retention has left, capped at
`soft_pin_max_s` (the master's `--max_kv_soft_pin_ttl`, default a day; a pin without TTL gets the
cap). Objects are immutable, so a pin is set, extended or dropped by rewriting the object's own
bytes with the new pin (`upsert`): when this instance reads a retained block whose pin would end
before half its retention left (or that has none from it), and when an unpin reaches a block it
pinned (a whole read and rewrite). A TTL that runs out needs nothing: the pin ends with it. The
pin has no priority (retained blocks go in the master's own order), and a pin stated by an instance
that stops ends with its TTL, at most the cap.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections import OrderedDict
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np

from kvpool.errors import ConfigError
from kvpool.store.health import PoolHealth
from kvpool.store.retained import RemoteRetentions, TierRetention
from kvpool.store.tier import StoreKey, TierStats

log = logging.getLogger(__name__)

NO_AVAILABLE_HANDLE = -200  # the pool is full right now
INVALID_PARAMS = -600  # e.g. a soft pin longer than the master's max_kv_soft_pin_ttl
OBJECT_HAS_LEASE = -706  # a reader holds a lease; the object cannot be removed yet
_MIB = 1 << 20
_HEADS = 4096  # headers remembered for layer reads
_RESTATE_S = 1.0


class MooncakeTier:
    """`mooncake://host:port[?segment_mb=64&buffer_mb=32&hostname=127.0.0.1&soft_pin_max_s=86400]`."""

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
        self.soft_pin_max_s = float(query.get("soft_pin_max_s", 86400))
        if not 0 < self.soft_pin_max_s < math.inf:
            raise ConfigError(f"soft_pin_max_s in {url!r} must be a number of seconds > 0")
        self.connect_timeout_s = connect_timeout_s
        self.max_value_bytes: int | None = None
        self.retention: TierRetention | None = None  # set by the store (follow_retention)
        self.pins_refused = False  # the master refused a soft pin: blocks are written unpinned
        self._stated = RemoteRetentions()
        self._heads: OrderedDict[StoreKey, tuple[bytes, int]] = OrderedDict()
        self._scratch: np.ndarray | None = None  # the range reads' buffer, registered with the client
        self._restate_at = 0.0
        self.restate_s = _RESTATE_S  # unpins are restated at most this often
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
        self._scratch = None  # registered with the old client
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

    # -- retention: soft pins (caller holds the lock) ---------------------------------------------
    def _wanted(self, key: StoreKey) -> tuple[float, float] | None:
        """(the table's time, seconds left) of `key`'s live retention, or None."""
        found = None if self.retention is None else self.retention.lookup_at()
        r = None if found is None else found[0](key)
        return None if r is None else (found[1], r.until - found[1])

    def _upsert(self, key: StoreKey, data: bytes, wanted: tuple[float, float] | None) -> int:
        """Write `data` with `wanted`'s soft pin (None: none, dropping one the object had) and note
        it. A pin the master refuses (longer than its maximum) is logged once, the block written
        unpinned; from then on retained blocks count in `retention_unhonoured`."""
        from mooncake.store import ReplicateConfig, SoftPinAction

        config = ReplicateConfig()
        if wanted is None:
            config.soft_pin_action = SoftPinAction.DISABLE
            return self._client.upsert(key, data, config)
        now, left = wanted
        pinned = min(left, self.soft_pin_max_s)
        config.soft_pin_action = SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = max(1, math.ceil(pinned * 1000))
        rc = self._client.upsert(key, data, config)
        if rc == INVALID_PARAMS:
            log.warning("mooncake tier %s: the master refused a soft pin of %.0f s (its --max_kv_soft_pin_ttl is "
                        "lower: set soft_pin_max_s in the URL); retained blocks are written unpinned",
                        self.name, pinned)
            self.pins_refused = True
            self._stats.retention_unhonoured += 1
            return self._client.put(key, data)
        if rc == 0 and self._stated.stated(key, now + pinned):
            self._stats.retention_applied += 1
        return rc

    def _repin(self, key: StoreKey, data: bytes | None) -> None:
        """State `key`'s retention again when the pin this tier gave it ends before half the
        retention left (or it has none from this tier): its own bytes rewritten with the pin."""
        wanted = self._wanted(key)
        if wanted is None or self.pins_refused:
            return
        now, left = wanted
        pinned = self._stated.until(key)
        if pinned is not None and pinned - now >= min(left, self.soft_pin_max_s) / 2:
            return
        data = data if data is not None else bytes(self._client.get(key))
        if data and self._upsert(key, data, wanted) not in (0, INVALID_PARAMS):
            log.debug("mooncake tier %s: pinning %s failed", self.name, key)

    def _restate(self) -> None:
        """Drop the soft pins of blocks released before their pin ends (an unpin): each object
        rewritten unpinned. A pin whose TTL ran out has ended in the master too."""
        clock = None if self.retention is None else self.retention.now()
        if clock is None or not len(self._stated) or time.monotonic() < self._restate_at:
            return
        self._restate_at = time.monotonic() + self.restate_s
        for key, pinned in self._stated.lapsed(self.retention.lookup()):
            data = bytes(self._client.get(key)) if pinned > clock else b""
            if data and self._upsert(key, data, None) == 0:
                self._stats.retention_applied += 1

    # -- the tier ------------------------------------------------------------------------------
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
            retained = None if self.retention is None else self.retention.lookup()
            self._stats.pinned_evictions += self._stated.gone(
                [k for k, hit in zip(keys, present, strict=True) if hit != 1], retained)
        for i, hit in enumerate(present):
            if hit != 1:
                return i
        return len(keys)

    def get(self, key: StoreKey) -> bytes | None:
        with self._lock, self._stats.timed_load():
            # An empty result is a miss or an RPC failure; lookup() tells them apart.
            data = self._client.get(key) if self._ready() else b""
            if not data or not self._sized(key, len(data)):
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            self._stats.bytes_read += len(data)
            data = bytes(data)
            self._repin(key, data)
            self._restate()
            return data

    def get_range(self, key: StoreKey, offset: int, length: int) -> tuple[bytes, int] | None:
        """Part of an object (tier.RangeReads), read into the registered buffer. A read from offset
        0 counts as the hit and is remembered (the layer-wise reader's header): a later read of the
        key reads those bytes again in the same request and returns nothing unless they are the
        same, so an object replaced meanwhile (removed and rewritten) never gives its bytes."""
        with self._lock:
            if not self._ready():
                if offset == 0:
                    self._stats.misses += 1
                return None
            if offset == 0:
                return self._open(key, length)
            held = self._heads.get(key)
            if held is None:
                return None
            head, size = held
            got = self._ranges(key, [(0, len(head)), (offset, min(length, size - offset))])
            if got is None or got[0] != head:
                return None
            self._stats.bytes_read += len(got[1])
            return got[1], size

    def _open(self, key: StoreKey, length: int) -> tuple[bytes, int] | None:
        """The header read of `get_range` (caller holds the lock)."""
        size = self._client.get_size(key)  # negative: a miss (-704) or a failed RPC
        got = self._ranges(key, [(0, min(length, size))]) if size > 0 and self._sized(key, size) else None
        if got is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._stats.bytes_read += len(got[0])
        self._heads[key] = (got[0], size)
        self._heads.move_to_end(key)
        if len(self._heads) > _HEADS:
            self._heads.popitem(last=False)
        self._repin(key, None)
        self._restate()
        return got[0], size

    def _ranges(self, key: StoreKey, spans: list[tuple[int, int]]) -> list[bytes] | None:
        """The bytes at `spans` ((offset, length), each > 0) of `key`'s object, in one read; None
        on a miss or a failure (caller holds the lock)."""
        total = sum(n for _, n in spans)
        if min(n for _, n in spans) <= 0:
            return None
        if self._scratch is None or self._scratch.nbytes < total:
            scratch = np.empty(max(total, self.max_value_bytes or 0), np.uint8)
            if self._scratch is not None:
                self._client.unregister_buffer(self._scratch.ctypes.data)
                self._scratch = None
            if self._client.register_buffer(scratch.ctypes.data, scratch.nbytes) != 0:
                log.warning("mooncake tier %s: registering a %d-byte read buffer failed", self.name, scratch.nbytes)
                return None
            self._scratch = scratch
        dst = [sum(n for _, n in spans[:i]) for i in range(len(spans))]
        sizes = [n for _, n in spans]
        got = self._client.get_into_ranges([self._scratch.ctypes.data], [[key]], [[dst]],
                                           [[[offset for offset, _ in spans]]], [[sizes]])
        if got[0][0] != sizes:
            return None
        return [self._scratch[d : d + n].tobytes() for d, n in zip(dst, sizes, strict=True)]

    def _sized(self, key: StoreKey, size: int) -> bool:
        """False (the object counted and removed as a bad entry) for one larger than any block."""
        if self.max_value_bytes is not None and size > self.max_value_bytes:
            self._stats.count_bad("size")
            self._client.remove(key)  # best effort (a lease may hold it a while)
            return False
        return True

    def put(self, key: StoreKey, data: bytes) -> bool:
        with self._lock, self._stats.timed_store():
            if not self._ready():
                self._stats.failed_puts += 1
                return False
            wanted = self._wanted(key)
            if wanted is not None and self.pins_refused:
                self._stats.retention_unhonoured += 1
            # a retained block is upserted: one another instance wrote unpinned gets the pin
            rc = self._client.put(key, data) if wanted is None or self.pins_refused else self._upsert(key, data, wanted)
            if rc == 0:
                self.health.succeeded()
                self._stats.puts += 1
                self._stats.bytes_written += len(data)
                self._restate()
                return True
            self._stats.failed_puts += 1
            if rc == NO_AVAILABLE_HANDLE:
                log.debug("mooncake tier %s full: put of %d bytes refused", self.name, len(data))
            else:
                self._fail("put", rc)
            return False

    def delete(self, key: StoreKey) -> None:
        self._stated.forget(key)
        with self._lock:
            if self._ready():
                rc = self._client.remove(key)
                if rc not in (0, OBJECT_HAS_LEASE) and rc < 0:
                    log.debug("mooncake tier %s: remove %s returned %d", self.name, key, rc)

    def stats(self) -> TierStats:
        with self._lock:
            if self._client is not None and self.health.available():
                self._restate()
            return self._stats.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
