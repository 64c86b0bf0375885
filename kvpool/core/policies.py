"""Eviction policies shared by the device block pool, the host/disk tiers and the simulator.

A policy orders the *evictable* keys of one cache. The cache tells it when a key becomes
evictable (`insert`), is used again while staying evictable (`touch`), stops being evictable
(`remove`), and asks it for the next victim (`pop_victim`). LRU and LFU are O(1) per operation, FIFO O(log n).
The batch forms (`insert_many`, `remove_many`, `pop_victims`) move a whole prompt's blocks in one
call; LRU does them with its ordered dict's own loops.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from itertools import repeat
from typing import Protocol

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

    def remove_many(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self.remove(key)

    def pop_victims(self, n: int) -> list[Hashable]:
        if n > len(self):
            raise KeyError(f"{n} victims wanted, {len(self)} evictable")
        return [self.pop_victim() for _ in range(n)]


class LRUPolicy:
    """Least recently used first. Insert order is recency order, so a cache that inserts a
    freed sequence's blocks tail-first evicts the tail (least shareable) blocks first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def pop_victim(self) -> Hashable:
        if not self._order:
            raise KeyError("no evictable key")
        return self._order.popitem(last=False)[0]

    def insert_many(self, keys: Iterable[Hashable]) -> None:
        order = self._order
        keys = list(keys)
        size = len(order)
        order.update(zip(keys, repeat(None)))  # appends the new keys in order
        if len(order) - size != len(keys):  # some were evictable already: move them too
            move = order.move_to_end
            for key in keys:
                move(key)

    def remove_many(self, keys: Iterable[Hashable]) -> None:
        order = self._order
        for key in keys:
            del order[key]

    def pop_victims(self, n: int) -> list[Hashable]:
        if n > len(self._order):
            raise KeyError(f"{n} victims wanted, {len(self._order)} evictable")
        pop = self._order.popitem
        return [pop(last=False)[0] for _ in range(n)]

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


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


def make_policy(name: str) -> EvictionPolicy:
    """Build the policy called `name` (lru, lfu or fifo)."""
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
