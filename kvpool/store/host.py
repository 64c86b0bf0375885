"""Host DRAM tier: a byte-bounded dict of encoded blocks, evicted in eviction-policy order.

Evicted blocks go to `on_evict(key, data)` so the store can demote them to a lower tier
(write-back). Thread-safe: the store's async workers call it concurrently. With `retention`
(set by the store) eviction honours the device pool's pins, TTLs and priorities (retained.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvpool.core.policies import make_policy
from kvpool.errors import ConfigError
from kvpool.store.retained import TierRetention, take_victims
from kvpool.store.tier import StoreKey, TierStats

log = logging.getLogger(__name__)

EvictCallback = Callable[[StoreKey, bytes], None]


class HostTier:
    """Blocks in process memory, at most `capacity_bytes` of values."""

    def __init__(self, capacity_bytes: int, policy: str = "lru", name: str = "host") -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"host tier capacity must be positive, got {capacity_bytes} bytes")
        self.name = name
        self.on_evict: EvictCallback | None = None
        self.max_value_bytes: int | None = None  # holds only what this process put
        self.retention: TierRetention | None = None
        self._blocks: dict[StoreKey, bytes] = {}
        self._policy = make_policy(policy)
        self._lock = threading.Lock()
        self._stats = TierStats(name=name, capacity_bytes=capacity_bytes)

    def contains(self, key: StoreKey) -> bool:
        return key in self._blocks

    def lookup(self, keys: list[StoreKey]) -> int:
        for i, key in enumerate(keys):
            if key not in self._blocks:
                return i
        return len(keys)

    def get(self, key: StoreKey) -> bytes | None:
        with self._lock, self._stats.timed_load():
            data = self._blocks.get(key)
            if data is None:
                self._stats.misses += 1
                return None
            self._policy.touch(key)
            self._stats.hits += 1
            self._stats.bytes_read += len(data)
            return data

    def get_range(self, key: StoreKey, offset: int, length: int) -> tuple[bytes, int] | None:
        """Part of a value (tier.RangeReads); a read from offset 0 counts as the hit."""
        with self._lock:
            data = self._blocks.get(key)
            if data is None:
                if offset == 0:
                    self._stats.misses += 1
                return None
            part = data[offset : offset + length]
            if offset == 0:
                self._policy.touch(key)
                self._stats.hits += 1
            self._stats.bytes_read += len(part)
            return part, len(data)

    def put(self, key: StoreKey, data: bytes) -> bool:
        evicted: list[tuple[StoreKey, bytes]] = []
        with self._lock, self._stats.timed_store():
            if key in self._blocks:
                self._policy.touch(key)
                return True
            if len(data) > self._stats.capacity_bytes:
                self._stats.failed_puts += 1
                return False
            over = self._stats.used_bytes + len(data) - self._stats.capacity_bytes
            retained = None if over <= 0 or self.retention is None else self.retention.lookup()
            victims, forced = take_victims(self._policy, over, lambda k: len(self._blocks[k]), retained)
            self._stats.pinned_evictions += forced
            for victim in victims:
                old = self._blocks.pop(victim)
                self._stats.used_bytes -= len(old)
                self._stats.evictions += 1
                evicted.append((victim, old))
            self._blocks[key] = data
            self._policy.insert(key)
            self._stats.used_bytes += len(data)
            self._stats.bytes_written += len(data)
            self._stats.puts += 1
        if self.on_evict is not None:
            for victim, old in evicted:
                self.on_evict(victim, old)
        return True

    def delete(self, key: StoreKey) -> None:
        with self._lock:
            data = self._blocks.pop(key, None)
            if data is not None:
                self._policy.remove(key)
                self._stats.used_bytes -= len(data)

    def present_keys(self) -> list[StoreKey]:
        """Present keys, for inspection and tests."""
        with self._lock:
            return list(self._blocks)

    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._stats.used_bytes = 0
