"""One interface for every KV tier (host DRAM, local disk, Redis, Mooncake Store).

Tiers move opaque encoded blocks (see format.py) under string keys that the store has
already namespaced; they never decode. A tier never raises into its caller for I/O
trouble: a remote pool that is down is a miss and a failed put, counted in its stats. An
entry that is there but cannot be a block (a Redis key of another type, a directory or FIFO
at a disk block path, a value of the wrong size) is a miss too, counted in `bad_entries`
by reason; the store adds the entries that fail to decode (see format.CorruptBlock).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

StoreKey = str


@dataclass(slots=True)
class TierStats:
    """Counters of one tier; latency sums are seconds measured around each call."""

    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    failed_puts: int = 0
    evictions: int = 0
    pinned_evictions: int = 0  # of those, blocks holding a live retention (nothing else could go)
    retention_applied: int = 0  # a remote pool told a block's retention began or lapsed
    retention_unhonoured: int = 0  # retained blocks met in a remote pool whose eviction ignores retention
    errors: int = 0
    lossy_loads: int = 0  # blocks served quantized (a lossy codec's), counted by the store
    load_time_s: float = 0.0
    load_count: int = 0
    store_time_s: float = 0.0
    store_count: int = 0
    read_latency_s: float = 0.0  # the store's online estimate of one read's fixed cost (0: none yet)
    read_bandwidth: float = 0.0  # ... and of its bytes per second, check included (0: none yet)
    bad_entries: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> entries met

    def snapshot(self) -> TierStats:
        return dataclasses.replace(self, bad_entries=dict(self.bad_entries))

    def count_bad(self, reason: str) -> None:
        self.bad_entries[reason] = self.bad_entries.get(reason, 0) + 1

    @contextmanager
    def timed_load(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.load_time_s += time.perf_counter() - start
            self.load_count += 1

    @contextmanager
    def timed_store(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.store_time_s += time.perf_counter() - start
            self.store_count += 1


@runtime_checkable
class Tier(Protocol):
    """A place that holds encoded blocks by key.

    `max_value_bytes` (set by the store: the largest block it writes) bounds what `get`
    reads; a larger value is a bad entry, never read whole."""

    name: str
    max_value_bytes: int | None

    def contains(self, key: StoreKey) -> bool:
        """Whether `key` is present now (a remote pool that is down answers False)."""

    def lookup(self, keys: list[StoreKey]) -> int:
        """Length of the longest prefix of `keys` that is present."""

    def get(self, key: StoreKey) -> bytes | None:
        """The stored value, or None on a miss or an I/O failure."""

    def put(self, key: StoreKey, data: bytes) -> bool:
        """Store `data` under `key`; False when it did not fit or the pool failed."""

    def delete(self, key: StoreKey) -> None:
        """Drop `key` if present."""

    def stats(self) -> TierStats:
        """A snapshot of this tier's counters."""

    def close(self) -> None:
        """Release connections and files; the tier is unusable afterwards."""


@runtime_checkable
class RangeReads(Protocol):
    """A tier that reads part of a value: a layer-wise reader reads a block's header and table,
    then one layer at a time (kvpool/store/layered.py). A tier without it is read whole."""

    def get_range(self, key: StoreKey, offset: int, length: int) -> tuple[bytes, int] | None:
        """Up to `length` bytes of the value at `offset` (fewer where it ends) and the value's
        whole size; None on a miss or an I/O failure. A read from offset 0 counts as the hit."""
