"""The conductor's view of which instance caches which KV blocks.

Fed by KV events from the instances (and from the shared pool, which reports as the
pseudo-instance `POOL`). A block is identified by its chained hash, so a block held by an
instance implies nothing about its parent: `prefix_match` therefore counts, per instance,
only the blocks it holds contiguously from block 0, which is what a prefill can reuse.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

from kvpool.core.hashing import BlockHash

POOL = "pool"


class GlobalKVIndex:
    """hash -> set of instances holding it, and the reverse map for O(held) removal."""

    __slots__ = ("_where", "_held")

    def __init__(self) -> None:
        self._where: dict[BlockHash, set[str]] = {}
        self._held: dict[str, set[BlockHash]] = {}

    def on_stored(self, instance_id: str, hashes: Iterable[BlockHash]) -> None:
        """`instance_id` now holds these blocks (re-storing a held block is a no-op)."""
        held = self._held.setdefault(instance_id, set())
        for h in hashes:
            if h not in held:
                held.add(h)
                self._where.setdefault(h, set()).add(instance_id)

    def on_evicted(self, instance_id: str, hashes: Iterable[BlockHash]) -> None:
        """`instance_id` dropped these blocks; unknown blocks are ignored (events may race)."""
        held = self._held.get(instance_id)
        if not held:
            return
        for h in hashes:
            if h in held:
                held.discard(h)
                self._drop(h, instance_id)
        if not held:
            del self._held[instance_id]

    def on_instance_down(self, instance_id: str) -> None:
        """Forget everything `instance_id` held: its memory is gone or unreachable."""
        for h in self._held.pop(instance_id, ()):
            self._drop(h, instance_id)

    def _drop(self, h: BlockHash, instance_id: str) -> None:
        holders = self._where[h]
        holders.discard(instance_id)
        if not holders:
            del self._where[h]

    def prefix_match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each instance holding block 0, how many leading blocks it holds contiguously.

        Walks the chain while some instance still matches; an instance drops out at its first
        missing block. Cost is O(matched blocks x holders), never O(all blocks cached).
        """
        if not hashes:
            return {}
        first = self._where.get(hashes[0])
        if not first:
            return {}
        alive = set(first)
        result: dict[str, int] = {}
        depth = 1
        for holders in map(self._where.get, islice(hashes, 1, None)):
            if holders is None:
                break
            if not alive <= holders:
                for inst in alive - holders:
                    result[inst] = depth
                alive &= holders
                if not alive:
                    return result
            depth += 1
        for inst in alive:
            result[inst] = depth
        return result

    def holders(self, h: BlockHash) -> frozenset[str]:
        """Instances holding block `h` (empty when none)."""
        return frozenset(self._where.get(h, ()))

    def num_blocks(self, instance_id: str) -> int:
        """How many blocks `instance_id` is known to hold."""
        return len(self._held.get(instance_id, ()))

    def instances(self) -> list[str]:
        """Instances holding at least one block, sorted."""
        return sorted(self._held)

    def __len__(self) -> int:
        """Distinct blocks cached anywhere."""
        return len(self._where)
