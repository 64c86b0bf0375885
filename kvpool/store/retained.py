"""Retention in the store tiers (issue 32, item 1): the device pool's rule, per tier.

A tier evicts first the blocks without a live retention, in its own policy's order, then the
retained ones, lower priority first (the policy's order among equals), as kvpool/core/retention.py
does for device blocks; a retained victim counts in the tier's `pinned_evictions`. The retentions
are the device pool's `RetentionTable`, which only the engine thread changes: the store's worker
threads read it one entry at a time (`get`, one dict read) and its `now` once per eviction, and
never iterate it. A store key is the store's prefix, maybe a quantization, then the block hash in
hex: the table's key. With no table, or an empty one, a tier pops its policy's victims as before.

A remote pool (Redis, Mooncake Store) evicts by its own policy in another process: its tier states
each block's retention in the pool's own terms (remote_redis.py, remote_mooncake.py) and keeps a
`RemoteRetentions` ledger of what it stated, to restate it when the retention changes and to count
a retained block found gone as a pinned eviction.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from kvpool.core.policies import EvictionPolicy
from kvpool.core.retention import Retention, RetentionTable, eviction_order, take_out
from kvpool.store.tier import StoreKey

RetainedOf = Callable[[StoreKey], Retention | None]


class TierRetention:
    """The live retention of a tier's keys, read from the table `source()` returns (the device
    pool's, which exists only once something was retained); keys without `prefix` (another
    namespace's or format's, left on a disk) are never retained."""

    def __init__(self, source: Callable[[], RetentionTable | None], prefix: str) -> None:
        self._source = source
        self._prefix = prefix

    def lookup(self) -> RetainedOf | None:
        """A key's live retention as of now, or None when nothing is retained (then a tier
        evicts exactly as without retention)."""
        found = self.lookup_at()
        return None if found is None else found[0]

    def now(self) -> float | None:
        """The table's time (the driver's clock), None without a table."""
        table = self._source()
        return None if table is None else table.now

    def lookup_at(self) -> tuple[RetainedOf, float] | None:
        """`lookup` and the table's time it reads against (a retention's seconds left are
        `until - now`: a remote pool is told durations, not the engine's clock)."""
        table = self._source()
        if table is None or not len(table):
            return None
        get, now, prefix = table.get, table.now, self._prefix

        def retained(key: StoreKey) -> Retention | None:
            if not key.startswith(prefix):
                return None
            try:
                r = get(bytes.fromhex(key.rsplit(":", 1)[-1]))
            except ValueError:
                return None
            return r if r is not None and r.until > now else None

        return retained, now


def take_victims(policy: EvictionPolicy, over: int, size_of: Callable[[StoreKey], int],
                 retained: RetainedOf | None) -> tuple[list[StoreKey], int]:
    """Victims whose sizes add up to at least `over` bytes (every key if they never do), taken
    out of `policy` as its own eviction would, and how many of them were retained. Without
    `retained`: the policy's `pop_victim`s, exactly as a tier without retention."""
    victims: list[StoreKey] = []
    if retained is None:
        while over > 0 and len(policy):
            key = policy.pop_victim()
            victims.append(key)
            over -= size_of(key)  # type: ignore[arg-type]
        return victims, 0
    forced = 0
    for key, kept in eviction_order(policy, retained):
        if over <= 0:
            break
        victims.append(key)
        over -= size_of(key)
        forced += kept
    take_out(policy, victims)
    return victims, forced


class RemoteRetentions:
    """Until when (the table's clock; inf: until told otherwise) a remote pool keeps each key
    retained as this tier stated it, to restate the ones whose retention lapses (an expiry, an
    unpin) and to notice a retained block gone. Thread-safe: the store's workers and the engine
    thread (lookups) share it. It holds only keys stated retained; each leaves when its retention
    lapses, when the tier deletes it or when it is found gone."""

    def __init__(self) -> None:
        self._until: dict[StoreKey, float] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._until)

    def stated(self, key: StoreKey, until: float) -> bool:
        """Record that the pool keeps `key` retained until `until`; True if that is news."""
        with self._lock:
            old = self._until.get(key)
            self._until[key] = until
        return old != until

    def until(self, key: StoreKey) -> float | None:
        """Until when the pool keeps `key` retained as stated (None: not stated)."""
        return self._until.get(key)

    def forget(self, key: StoreKey) -> None:
        with self._lock:
            self._until.pop(key, None)

    def lapsed(self, retained: RetainedOf | None) -> list[tuple[StoreKey, float]]:
        """The keys whose retention is no longer live (expired, released), with their stated
        `until`, forgotten here: the pool must be told they are ordinary blocks again."""
        with self._lock:
            out = [(k, u) for k, u in self._until.items() if retained is None or retained(k) is None]
            for key, _ in out:
                del self._until[key]
        return out

    def drain(self) -> list[StoreKey]:
        """Every key stated retained, forgotten (the tier closes: its retentions end with it)."""
        with self._lock:
            out, self._until = list(self._until), {}
        return out

    def gone(self, keys: Iterable[StoreKey], retained: RetainedOf | None) -> int:
        """Of `keys`, found absent from the pool, how many were stated retained and still are:
        retained blocks the pool evicted (or someone deleted). They are forgotten."""
        n = 0
        with self._lock:
            for key in keys:
                if self._until.pop(key, None) is not None and retained is not None and retained(key) is not None:
                    n += 1
        return n
