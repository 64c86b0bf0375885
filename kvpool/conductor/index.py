"""The conductor's view of which instance caches which KV blocks.

Fed by KV events from the instances (and from the shared pool, which reports as the
pseudo-instance `POOL`). A block is identified by its chained hash, so a block held by an
instance implies nothing about its parent: `prefix_match` therefore counts, per instance,
only the blocks it holds contiguously from block 0, which is what a prefill can reuse.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import takewhile

from kvpool.core.hashing import BlockHash

POOL = "pool"


class GlobalKVIndex:
    """Per instance, the set of block hashes it holds. KV events arrive by the thousand blocks
    (a long prompt), so storing and evicting are whole-set operations; a prefix match walks
    only the instances holding block 0, each as far as it matches."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[str, set[BlockHash]] = {}

    def on_stored(self, instance_id: str, hashes: Iterable[BlockHash]) -> None:
        """`instance_id` now holds these blocks (re-storing a held block is a no-op)."""
        self._held.setdefault(instance_id, set()).update(hashes)

    def on_evicted(self, instance_id: str, hashes: Iterable[BlockHash]) -> None:
        """`instance_id` dropped these blocks; unknown blocks are ignored (events may race)."""
        held = self._held.get(instance_id)
        if not held:
            return
        held.difference_update(hashes)
        if not held:
            del self._held[instance_id]

    def on_instance_down(self, instance_id: str) -> None:
        """Forget everything `instance_id` held: its memory is gone or unreachable."""
        self._held.pop(instance_id, None)

    def prefix_match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each instance holding block 0, how many leading blocks it holds contiguously.
        Cost is O(instances + matched blocks), never O(all blocks cached)."""
        if not hashes:
            return {}
        first = hashes[0]
        return {
            inst: len(list(takewhile(held.__contains__, hashes)))
            for inst, held in self._held.items()
            if first in held
        }

    def holders(self, h: BlockHash) -> frozenset[str]:
        """Instances holding block `h` (empty when none)."""
        return frozenset(inst for inst, held in self._held.items() if h in held)

    def num_blocks(self, instance_id: str) -> int:
        """How many blocks `instance_id` is known to hold."""
        return len(self._held.get(instance_id, ()))

    def instances(self) -> list[str]:
        """Instances holding at least one block, sorted."""
        return sorted(inst for inst, held in self._held.items() if held)

    def __len__(self) -> int:
        """Distinct blocks cached anywhere (O(all blocks held): for reports, not routing)."""
        return len(set().union(*self._held.values()))
