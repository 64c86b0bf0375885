"""Redis as a shared remote KV pool: one value per block, `SET NX` so racing writers agree.

Blocks are immutable and content-addressed, so when two engines save the same block the
second write is redundant; NX makes it a no-op instead of a rewrite. Timeouts are short and
a down server is a miss (see health.py). Every Redis error is a miss, never an exception to the
caller: a key of another type under one of the store's names (WRONGTYPE) is a bad entry, counted
and deleted (the store's key prefix makes it the store's own); reads fetch at most one byte more
than `max_value_bytes` (GETRANGE), so an oversized value is a bad entry, never read whole.
Layer-wise reads (`get_range`, tier.RangeReads) read a value's header, then one layer at a time.

Retention (issue 32, item 1) with Redis's own eviction, its `maxmemory-policy`, read at connect:
a `volatile-*` policy evicts only keys that carry an expiry, so under one every unretained block
gets an expiry (`idle_expire_s`, default a day, pushed back by each read) and a retained one none
(PERSIST): Redis evicts every unretained block first and never a retained one (a pool full of
retained blocks refuses writes: `failed_puts`). Under `volatile-ttl`, which evicts the nearest
expiry first, a retained block gets a far expiry ranked by its priority instead: retained blocks
are evicted only when no unretained one is left, lower priority first, and counted
(`pinned_evictions`), as the device pool does. Retention is stated when this instance writes,
reads or looks a block up, and a retention that lapses (expiry, unpin) gives the key its expiry
back on the tier's next write, read or stats call, at most once a second (retained.RemoteRetentions);
close does so for every key it persisted.
An `allkeys-*` policy evicts retained blocks like others: logged at connect, and each retained
block written there counts in `retention_unhonoured`; under `noeviction` nothing is evicted and no
key gets an expiry. A server that refuses CONFIG GET is treated as volatile-* (logged).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvpool.core.retention import Retention
from kvpool.errors import ConfigError
from kvpool.store.health import PoolHealth
from kvpool.store.retained import RemoteRetentions, RetainedOf, TierRetention
from kvpool.store.tier import StoreKey, TierStats

log = logging.getLogger(__name__)

_DOWN = (redis.ConnectionError, redis.TimeoutError)
IDLE_EXPIRE_S = 24 * 3600  # an unretained block's expiry under a volatile-* policy
# volatile-ttl evicts the nearest expiry first: a retained key's expiry there, far past any
# unretained one's and a month later per priority point, so retained blocks go only after every
# unretained one, lower priority first (other volatile-* policies: no expiry, never evicted)
RETAINED_EXPIRE_S = 10 * 365 * 24 * 3600
PRIORITY_EXPIRE_S = 30 * 24 * 3600
UNKNOWN_POLICY = "unknown"  # the server would not say (CONFIG refused)
_RESTATE_S = 1.0
_HEADS = 4096  # headers remembered for layer reads (blocks being read layer by layer)


def _own_options(url: str) -> tuple[str, int]:
    """The URL without kvpool's own query option, and `idle_expire_s` (seconds, > 0)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = [v for k, v in query if k == "idle_expire_s"]
    try:
        idle = int(ours[-1]) if ours else IDLE_EXPIRE_S
    except ValueError:
        idle = 0
    if idle <= 0:
        raise ConfigError(f"idle_expire_s in {url!r} must be a whole number of seconds > 0, got {ours[-1]!r}")
    rest = urlencode([(k, v) for k, v in query if k != "idle_expire_s"])
    return urlunsplit(parts._replace(query=rest)), idle


class RedisTier:
    """A Redis server at `redis://host:port[/db][?idle_expire_s=86400]` holding encoded blocks."""

    def __init__(self, url: str, timeout_s: float = 0.5, retry_s: float = 1.0, name: str = "redis") -> None:
        self.name = name
        self.url = url
        server_url, self.idle_expire_s = _own_options(url)
        self._client = redis.Redis.from_url(
            server_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
        )
        self.max_value_bytes: int | None = None
        self.retention: TierRetention | None = None  # set by the store (follow_retention)
        self.policy: str | None = None  # the server's maxmemory-policy, read at connect
        self._stated = RemoteRetentions()
        self._heads: OrderedDict[StoreKey, bytes] = OrderedDict()
        self._lock = threading.Lock()  # guards _heads and _restate_at
        self._restate_at = 0.0
        self.restate_s = _RESTATE_S  # lapsed retentions are restated at most this often
        self._stats = TierStats(name=name)
        self.health = PoolHealth(f"{name} ({url})", self._stats, retry_s=retry_s)

    # -- retention ---------------------------------------------------------------------------
    @property
    def honours_retention(self) -> bool | None:
        """Whether the server's policy keeps retained blocks over others (None: not read yet)."""
        if self.policy is None:
            return None
        return not self.policy.startswith("allkeys-")

    def _expiring(self) -> bool:
        """Whether keys carry expiries: under a volatile-* policy (or one the server would not tell)."""
        if self.policy is None:
            self._read_policy()
        return self.policy is not None and (self.policy.startswith("volatile-") or self.policy == UNKNOWN_POLICY)

    def _read_policy(self) -> None:
        try:
            policy = self._client.config_get("maxmemory-policy").get("maxmemory-policy")
        except _DOWN as exc:
            self.health.failed("config get", exc)
            return
        except redis.RedisError as exc:  # CONFIG renamed or not permitted (managed Redis)
            log.warning("redis tier %s: cannot read maxmemory-policy (%s); giving unretained blocks an expiry as "
                        "for a volatile-* policy: retention holds only if the server's policy is volatile-*",
                        self.name, exc)
            self.policy = UNKNOWN_POLICY
            return
        self.policy = policy or UNKNOWN_POLICY
        log.info("redis tier %s: maxmemory-policy %s; retained blocks are %s", self.name, self.policy,
                 "evicted like any other (retention NOT honoured)" if self.policy.startswith("allkeys-")
                 else "never evicted (nothing is)" if self.policy == "noeviction"
                 else "evicted after every unretained block, lower priority first" if self.policy == "volatile-ttl"
                 else "never evicted by Redis")

    def _retained(self) -> RetainedOf | None:
        return None if self.retention is None else self.retention.lookup()

    def _state(self, pipe, key: StoreKey, retained: RetainedOf | None, expiring: bool) -> bool:
        """Queue what Redis must hold of `key`'s retention (an accessed unretained block's expiry
        pushed back: GT never shortens one, nor touches a persisted key); whether it is retained."""
        r = retained(key) if retained is not None else None
        if expiring:
            if r is not None:
                self._keep(pipe, key, r)
            else:
                pipe.expire(key, self.idle_expire_s, gt=True)
        return r is not None

    def _keep(self, pipe, key: StoreKey, retention: Retention) -> None:
        """Queue how Redis keeps retained `key`: no expiry (no volatile-* policy evicts it), or under
        volatile-ttl a far one ranked by priority (evicted only when no unretained key is left)."""
        if self.policy == "volatile-ttl":
            pipe.expire(key, RETAINED_EXPIRE_S + max(retention.priority, 0) * PRIORITY_EXPIRE_S)
        else:
            pipe.persist(key)

    def _stated_now(self, key: StoreKey, kept: bool, expiring: bool) -> None:
        """`key` is in the pool and was stated retained (`kept`: PERSIST holds until told otherwise)."""
        if not kept or not self._stated.stated(key, math.inf):
            return
        if self.honours_retention is False:
            if not self._stats.retention_unhonoured:
                log.warning("redis tier %s: maxmemory-policy %s evicts retained (pinned, TTL'd) blocks like any "
                            "other: retention is NOT honoured in this pool; use a volatile-* policy (e.g. "
                            "volatile-lru)", self.name, self.policy)
            self._stats.retention_unhonoured += 1
        elif expiring:
            self._stats.retention_applied += 1

    def _restate(self, force: bool = False) -> None:
        """Give the keys whose retention lapsed their expiry back (at most every `restate_s`); ones
        the server could not be told (down) are tried again later."""
        now = time.monotonic()
        with self._lock:
            if not len(self._stated) or (not force and now < self._restate_at):
                return
            self._restate_at = now + self.restate_s
        lapsed = self._stated.drain() if force else [key for key, _ in self._stated.lapsed(self._retained())]
        if not lapsed:
            return
        expiring = self.health.available() and self._expiring()
        if expiring and self._expire(lapsed):
            self._stats.retention_applied += len(lapsed)
        elif expiring or self.policy is None:
            for key in lapsed:
                self._stated.stated(key, math.inf)

    def _expire(self, keys: list[StoreKey]) -> bool:
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.expire(key, self.idle_expire_s)
            pipe.execute()
        except _DOWN as exc:
            self._down("restate", exc)
            return False
        except redis.RedisError as exc:
            self._unexpected("restate", exc)
            return False
        return True

    # -- the tier ------------------------------------------------------------------------------
    def contains(self, key: StoreKey) -> bool:
        return self.lookup([key]) == 1

    def lookup(self, keys: list[StoreKey]) -> int:
        """Present prefix length; retained keys are stated (PERSIST) in the same round trip, and a
        key stated retained that is gone while still retained counts as a pinned eviction."""
        if not keys or not self.health.available():
            return 0
        retained = self._retained()
        expiring = self._expiring()
        kept: list[StoreKey] = []
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            for key in keys:
                r = retained(key) if retained is not None else None
                if r is not None:
                    kept.append(key)
                    if expiring:
                        self._keep(pipe, key, r)
            present = pipe.execute()[: len(keys)]
        except _DOWN as exc:
            self._down("lookup", exc)
            return 0
        except redis.RedisError as exc:
            self._unexpected("lookup", exc)
            return 0
        self.health.succeeded()
        missing = {key for key, hit in zip(keys, present, strict=True) if not hit}
        self._stats.pinned_evictions += self._stated.gone(missing, retained)
        for key in kept:
            if key not in missing:
                self._stated_now(key, True, expiring)
        return present.index(0) if 0 in present else len(keys)

    def get(self, key: StoreKey) -> bytes | None:
        with self._stats.timed_load():
            if self.max_value_bytes is None:
                got = self._read(key, "get", lambda pipe: pipe.get(key))
            else:  # an empty string for a missing key
                got = self._read(key, "get", lambda pipe: pipe.getrange(key, 0, self.max_value_bytes))
            data = None if got is None else got[0]
            if not data or not self._sized(key, len(data)):
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            self._stats.bytes_read += len(data)
            return data

    def get_range(self, key: StoreKey, offset: int, length: int) -> tuple[bytes, int] | None:
        """Part of a value (tier.RangeReads), with its size, read with the size in one transaction.
        A read from offset 0 counts as the hit and is remembered (the layer-wise reader's header):
        a later read of the key returns nothing unless the value still starts with those bytes, so
        a value replaced meanwhile (evicted and rewritten, another block's) never gives its bytes."""
        end = offset + max(length, 1) - 1
        if offset == 0:
            got = self._read(key, "get_range", lambda pipe: (pipe.getrange(key, 0, end), pipe.strlen(key)), 2)
            if got is None or not got[1] or not self._sized(key, got[1]):
                self._stats.misses += 1
                return None
            data, size = got[0][:length], got[1]
            self._stats.hits += 1
            with self._lock:
                self._heads[key] = data
                self._heads.move_to_end(key)
                if len(self._heads) > _HEADS:
                    self._heads.popitem(last=False)
        else:
            head = self._heads.get(key)
            if not head:
                return None
            got = self._read(key, "get_range", lambda pipe: (pipe.getrange(key, 0, len(head) - 1),
                                                             pipe.getrange(key, offset, end), pipe.strlen(key)), 3,
                             retention=False)
            if got is None or got[0] != head:
                return None
            data, size = got[1][:length], got[2]
        self._stats.bytes_read += len(data)
        return data, size

    def _read(self, key: StoreKey, what: str, queue, replies: int = 1, retention: bool = True) -> list | None:
        """Run the read `queue(pipe)` queues (`replies` replies) in one transaction, with the
        block's retention stated; None on a miss by failure (down, WRONGTYPE: a bad entry)."""
        if not self.health.available():
            return None
        retained = self._retained() if retention else None
        expiring = retention and self._expiring()
        try:
            pipe = self._client.pipeline(transaction=True)
            queue(pipe)
            kept = retention and self._state(pipe, key, retained, expiring)
            got = pipe.execute()[:replies]
        except _DOWN as exc:
            self._down(what, exc)
            return None
        except redis.ResponseError as exc:
            self.health.succeeded()
            if "WRONGTYPE" in str(exc):
                self._drop_bad(key, "wrong_type", "holds another type")
            else:
                self._unexpected(what, exc)
            return None
        except redis.RedisError as exc:
            self._unexpected(what, exc)
            return None
        self.health.succeeded()
        if retention:
            if got[-1]:  # the value (or its size) is there
                self._stated_now(key, kept, expiring)
            self._restate()
        return got

    def _sized(self, key: StoreKey, size: int) -> bool:
        """False (the key dropped as a bad entry) for a value larger than any block."""
        if self.max_value_bytes is not None and size > self.max_value_bytes:
            self._drop_bad(key, "size", "holds more than a block")
            return False
        return True

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
            retained = self._retained()
            expiring = self._expiring()
            r = None if retained is None else retained(key)
            try:
                pipe = self._client.pipeline(transaction=False)
                pipe.set(key, data, nx=True, ex=self.idle_expire_s if expiring and r is None else None)
                if expiring and r is not None:  # also a block another instance wrote unretained
                    self._keep(pipe, key, r)
                written = pipe.execute()[0]
            except _DOWN as exc:
                self._down("put", exc)
                self._stats.failed_puts += 1
                return False
            except redis.ResponseError as exc:  # e.g. OOM: full, nothing (else) evictable
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
            self._stated_now(key, r is not None, expiring)
        self._restate()
        return True

    def delete(self, key: StoreKey) -> None:
        self._stated.forget(key)
        if not self.health.available():
            return
        try:
            self._client.delete(key)
        except _DOWN as exc:
            self._down("delete", exc)
        except redis.RedisError as exc:
            self._unexpected("delete", exc)

    def _down(self, what: str, exc: Exception) -> None:
        """An outage: marked down; the policy is read again on reconnect (a restarted server's)."""
        self.policy = None
        self.health.failed(what, exc)

    def _unexpected(self, what: str, exc: redis.RedisError) -> None:
        """A reply the tier cannot use (not an outage): counted, logged, a miss."""
        log.warning("redis tier %s: %s failed: %s: %s", self.name, what, type(exc).__name__, exc)
        self._stats.errors += 1

    def stats(self) -> TierStats:
        self._restate()
        snap = self._stats.snapshot()
        if self.health.available():
            try:
                info = self._client.info("memory")
            except _DOWN as exc:
                self._down("stats", exc)
            except redis.RedisError as exc:
                self._unexpected("stats", exc)
            else:
                snap.used_bytes = int(info.get("used_memory", 0))
                snap.capacity_bytes = int(info.get("maxmemory", 0))
        return snap

    def close(self) -> None:
        """Release the connection; blocks this instance kept retained get their expiry back (its
        retentions end with it)."""
        self._restate(force=True)
        self._client.close()
