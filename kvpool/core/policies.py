"""Eviction policies shared by the device block pool, the host/disk tiers and the simulator.

A policy orders the *evictable* keys of one cache. The cache tells it when a key becomes
evictable (`insert`), is used again while staying evictable (`touch`), stops being evictable
(`remove`), and asks it for the next victim (`pop_victim`). LRU and LFU are O(1) per operation
(LRU amortized), FIFO O(log n). The batch forms (`insert_many`, `remove_many`, `pop_victims`)
move a whole prompt's blocks in one call; LRU does them mostly at C speed.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from itertools import repeat
from typing import Protocol

from kvpool.core.lru_stamps import DictStamps, ListStamps
from kvpool.errors import ConfigError


class EvictionPolicy(Protocol):
    def insert(self, key: Hashable) -> None:
        """`key` became evictable (counts as one access)."""

    def touch(self, key: Hashable) -> None:
        """`key` was accessed and stays evictable."""

    def remove(self, key: Hashable) -> None:
        """`key` is no longer evictable (in use again, or deleted by the cache)."""

    def pop_victim(self) -> Hashable:
        """Remove and return the key to evict next; KeyError when empty."""

    def insert_many(self, keys: Iterable[Hashable]) -> None:
        """`insert` each key, in order."""

    def insert_new(self, keys: list[Hashable]) -> None:
        """`insert_many` of distinct keys none of which is evictable now (a pool's blocks as
        they are released): the policy may skip checking them."""

    def remove_many(self, keys: Iterable[Hashable]) -> None:
        """`remove` each key."""

    def pop_victims(self, n: int) -> list[Hashable]:
        """`pop_victim` n times; KeyError (having popped none) when fewer keys are evictable."""

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


class _Batched:
    """The batch operations as loops over the single ones; a policy may do better."""

    def insert_many(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self.insert(key)

    def insert_new(self, keys: list[Hashable]) -> None:
        self.insert_many(keys)

    def remove_many(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self.remove(key)

    def pop_victims(self, n: int) -> list[Hashable]:
        if n > len(self):
            raise KeyError(f"{n} victims wanted, {len(self)} evictable")
        return [self.pop_victim() for _ in range(n)]


class LRUPolicy:
    """Least recently used first. Insert order is recency order, so a cache that inserts a
    freed sequence's blocks tail-first evicts the tail (least shareable) blocks first.

    A block pool moves whole prompts (thousands of blocks) in and out, so the order is a log
    that batches append to and victims are read from, with one stamp write per key: `_keys`
    logs the inserted keys in order and `_stamps` the stamp of their insertion at the same
    positions (one new object per `insert_many`), and `_slots` holds each evictable key's
    latest stamp. An entry is live while its key's stamp is still the entry's (an identity
    test): a later insert, touch or remove of the key leaves it stale. Victims are the live
    entries from `_head` on. With `num_keys`, keys are the ints below it (block ids).
    """

    def __init__(self, num_keys: int | None = None) -> None:
        self._slots = DictStamps() if num_keys is None else ListStamps(num_keys)
        self._keys: list[Hashable] = []
        self._stamps: list[object] = []
        self._head = 0

    def insert(self, key: Hashable) -> None:
        self.insert_many((key,))

    def touch(self, key: Hashable) -> None:
        if key not in self._slots:
            raise KeyError(key)
        self.insert_many((key,))

    def remove(self, key: Hashable) -> None:
        self._slots.drop((key,))

    def pop_victim(self) -> Hashable:
        if not self._slots:
            raise KeyError("no evictable key")
        return self.pop_victims(1)[0]

    def insert_many(self, keys: Iterable[Hashable]) -> None:
        log = self._keys
        start = len(log)
        log.extend(keys)
        batch = log[start:]
        stamp = object()
        self._stamps.extend(repeat(stamp, len(batch)))
        if self._slots.assign(batch, stamp):  # a repeated key: its last insert must win
            del log[start:], self._stamps[start:]
            for key in batch:
                self.insert_many((key,))
        self._compact()

    def insert_new(self, keys: list[Hashable]) -> None:
        stamp = object()
        self._keys.extend(keys)
        self._stamps.extend(repeat(stamp, len(keys)))
        self._slots.assign_new(keys, stamp)
        self._compact()

    def remove_many(self, keys: Iterable[Hashable]) -> None:
        self._slots.drop(keys)

    def pop_victims(self, n: int) -> list[Hashable]:
        if n > len(self._slots):
            raise KeyError(f"{n} victims wanted, {len(self._slots)} evictable")
        victims: list[Hashable] = []
        while len(victims) < n:  # each pass reads as many entries as victims are missing
            start, self._head = self._head, self._head + n - len(victims)
            victims += self._slots.take(self._keys[start : self._head], self._stamps[start : self._head])
        self._compact()
        return victims

    def _compact(self) -> None:
        """Drop dead entries: those before `_head` once they are half the log, and the stale
        ones too once the log is over four times the evictable keys. Either pass is proportional to
        the entries it drops, so amortized O(1) per operation; memory stays O(evictable keys)."""
        if self._head > len(self._keys) // 2:
            del self._keys[: self._head], self._stamps[: self._head]
            self._head = 0
        if len(self._keys) > 4 * len(self._slots) + 1024:
            self._keys = self._slots.live(self._keys[self._head :], self._stamps[self._head :])
            self._stamps = self._slots.stamps(self._keys)
            self._head = 0

    def order(self) -> list[Hashable]:
        """The evictable keys, next victim first (for inspection and tests)."""
        return self._slots.live(self._keys[self._head :], self._stamps[self._head :])

    def iter_order(self) -> Iterator[Hashable]:
        """`order`, lazily in chunks (retention reads only as far as it needs; the policy must
        not change while this runs)."""
        keys, stamps, live = self._keys, self._stamps, self._slots.live
        for i in range(self._head, len(keys), 256):
            yield from live(keys[i : i + 256], stamps[i : i + 256])

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)


class FIFOPolicy(_Batched):
    """First cached first out: a key keeps the position of its first insertion while it goes
    in and out of use, and an access does not refresh it. O(log n) through a lazy heap."""

    def __init__(self) -> None:
        self._ticket: dict[Hashable, int] = {}
        self._present: set[Hashable] = set()
        self._heap: list[tuple[int, Hashable]] = []
        self._next = 0

    def insert(self, key: Hashable) -> None:
        if key in self._present:
            return
        if key not in self._ticket:
            self._ticket[key] = self._next
            self._next += 1
        self._present.add(key)
        heapq.heappush(self._heap, (self._ticket[key], key))

    def touch(self, key: Hashable) -> None:
        pass

    def remove(self, key: Hashable) -> None:
        self._present.remove(key)

    def pop_victim(self) -> Hashable:
        while self._heap:
            ticket, key = heapq.heappop(self._heap)
            if key in self._present and self._ticket.get(key) == ticket:
                self._present.remove(key)
                del self._ticket[key]
                return key
        raise KeyError("no evictable key")

    def iter_order(self) -> Iterator[Hashable]:
        """The evictable keys, next victim first, lazily (for retention; no change meanwhile)."""
        heap, ticket, present = list(self._heap), self._ticket, self._present
        last = None
        while heap:
            entry = heapq.heappop(heap)  # a key reinserted with its ticket has equal entries: adjacent
            t, key = entry
            if entry != last and key in present and ticket.get(key) == t:
                yield key
            last = entry

    def forget(self, key: Hashable) -> None:
        """Drop the remembered position of a key that is not evictable now."""
        self._present.discard(key)
        self._ticket.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._present

    def __len__(self) -> int:
        return len(self._present)


class LFUPolicy(_Batched):
    """Least frequently used first, least recently used among equals (O(1) LFU buckets).

    A key's count survives `remove` (a block in use is still popular when it is freed
    again) and is forgotten only when the key is evicted.
    """

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}
        self._buckets: dict[int, OrderedDict[Hashable, None]] = {}
        self._present: dict[Hashable, int] = {}
        self._min = 0

    def _bucket_add(self, key: Hashable, count: int) -> None:
        self._buckets.setdefault(count, OrderedDict())[key] = None
        self._present[key] = count
        if len(self._present) == 1 or count < self._min:
            self._min = count

    def _bucket_del(self, key: Hashable) -> None:
        count = self._present.pop(key)
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]
            if count == self._min and self._buckets:
                self._min = min(self._buckets)

    def insert(self, key: Hashable) -> None:
        if key in self._present:
            self.touch(key)
            return
        count = self._count.get(key, 0) + 1
        self._count[key] = count
        self._bucket_add(key, count)

    def touch(self, key: Hashable) -> None:
        self._bucket_del(key)
        self._count[key] += 1
        self._bucket_add(key, self._count[key])

    def remove(self, key: Hashable) -> None:
        self._bucket_del(key)

    def pop_victim(self) -> Hashable:
        if not self._present:
            raise KeyError("no evictable key")
        key = next(iter(self._buckets[self._min]))
        self._bucket_del(key)
        del self._count[key]
        return key

    def iter_order(self) -> Iterator[Hashable]:
        """The evictable keys, next victim first, lazily (for retention; no change meanwhile)."""
        for count in sorted(self._buckets):
            yield from self._buckets[count]

    def forget(self, key: Hashable) -> None:
        """Drop the remembered count of a key that is not evictable now."""
        if key in self._present:
            self._bucket_del(key)
        self._count.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._present

    def __len__(self) -> int:
        return len(self._present)


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str, num_keys: int | None = None) -> EvictionPolicy:
    """Build the policy called `name` (lru, lfu or fifo). `num_keys` says the keys are the ints
    below it (a pool's block ids), which LRU keeps in a list."""
    try:
        policy = POLICIES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return LRUPolicy(num_keys) if policy is LRUPolicy else policy()
