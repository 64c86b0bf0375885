"""Redis as a shared remote KV pool: one value per block, `SET NX` so racing writers agree.

Blocks are immutable and content-addressed, so when two engines save the same block the
second write is redundant; NX makes it a no-op instead of a rewrite. Timeouts are short and
a down server is a miss (see health.py); eviction is Redis's own `maxmemory-policy`. Every
Redis error is a miss, never an exception to the caller: a key of another type under one of
the store's names (WRONGTYPE) is a bad entry, counted and deleted (the store's key prefix
makes it the store's own); reads fetch at most one byte more than `max_value_bytes`
(GETRANGE), so an oversized value is a bad entry, never read whole.
"""

from __future__ import annotations

import logging

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvpool.store.health import PoolHealth
from kvpool.store.tier import StoreKey, TierStats

log = logging.getLogger(__name__)

_DOWN = (redis.ConnectionError, redis.TimeoutError)


class RedisTier:
    """A Redis server at `redis://host:port[/db]` holding encoded blocks."""

    def __init__(self, url: str, timeout_s: float = 0.5, retry_s: float = 1.0, name: str = "redis") -> None:
        self.name = name
        self.url = url
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
        )
        self.max_value_bytes: int | None = None
        self._stats = TierStats(name=name)
        self.health = PoolHealth(f"{name} ({url})", self._stats, retry_s=retry_s)

    def contains(self, key: StoreKey) -> bool:
        return self.lookup([key]) == 1

    def lookup(self, keys: list[StoreKey]) -> int:
        if not keys or not self.health.available():
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            present = pipe.execute()
        except _DOWN as exc:
            self.health.failed("lookup", exc)
            return 0
        except redis.RedisError as exc:
            self._unexpected("lookup", exc)
            return 0
        self.health.succeeded()
        for i, hit in enumerate(present):
            if not hit:
                return i
        return len(keys)

    def get(self, key: StoreKey) -> bytes | None:
        with self._stats.timed_load():
            if not self.health.available():
                self._stats.misses += 1
                return None
            try:
                if self.max_value_bytes is None:
                    data = self._client.get(key)
                else:  # an empty string for a missing key
                    data = self._client.getrange(key, 0, self.max_value_bytes)
            except _DOWN as exc:
                self.health.failed("get", exc)
                self._stats.misses += 1
                return None
            except redis.ResponseError as exc:
                self.health.succeeded()
                if str(exc).startswith("WRONGTYPE"):
                    self._drop_bad(key, "wrong_type", "holds another type")
                else:
                    self._unexpected("get", exc)
                self._stats.misses += 1
                return None
            except redis.RedisError as exc:
                self._unexpected("get", exc)
                self._stats.misses += 1
                return None
            self.health.succeeded()
            if not data:
                self._stats.misses += 1
                return None
            if self.max_value_bytes is not None and len(data) > self.max_value_bytes:
                self._drop_bad(key, "size", "holds more than a block")
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            self._stats.bytes_read += len(data)
            return data

    def _drop_bad(self, key: StoreKey, reason: str, what: str) -> None:
        """A key under our prefix that cannot be a block: count it and delete it (a miss)."""
        log.warning("redis tier %s: key %s %s; treating it as a miss and deleting it", self.name, key, what)
        self._stats.count_bad(reason)
        self.delete(key)

    def put(self, key: StoreKey, data: bytes) -> bool:
        with self._stats.timed_store():
            if not self.health.available():
                self._stats.failed_puts += 1
                return False
            try:
                written = self._client.set(key, data, nx=True)
            except _DOWN as exc:
                self.health.failed("put", exc)
                self._stats.failed_puts += 1
                return False
            except redis.ResponseError as exc:  # e.g. OOM under maxmemory-policy noeviction
                log.debug("redis tier %s: put of %d bytes refused: %s", self.name, len(data), exc)
                self.health.succeeded()
                self._stats.failed_puts += 1
                return False
            except redis.RedisError as exc:
                self._unexpected("put", exc)
                self._stats.failed_puts += 1
                return False
            self.health.succeeded()
            self._stats.puts += 1
            if written:
                self._stats.bytes_written += len(data)
            return True

    def delete(self, key: StoreKey) -> None:
        if not self.health.available():
            return
        try:
            self._client.delete(key)
        except _DOWN as exc:
            self.health.failed("delete", exc)
        except redis.RedisError as exc:
            self._unexpected("delete", exc)

    def _unexpected(self, what: str, exc: redis.RedisError) -> None:
        """A reply the tier cannot use (not an outage): counted, logged, a miss."""
        log.warning("redis tier %s: %s failed: %s: %s", self.name, what, type(exc).__name__, exc)
        self._stats.errors += 1

    def stats(self) -> TierStats:
        snap = self._stats.snapshot()
        if self.health.available():
            try:
                info = self._client.info("memory")
            except _DOWN as exc:
                self.health.failed("stats", exc)
            except redis.RedisError as exc:
                self._unexpected("stats", exc)
            else:
                snap.used_bytes = int(info.get("used_memory", 0))
                snap.capacity_bytes = int(info.get("maxmemory", 0))
        return snap

    def close(self) -> None:
        self._client.close()
