"""The conductor's view of which instance caches which KV blocks.

Fed by KV events from the instances (and from the shared pool, which reports as the
pseudo-instance `POOL`). A block is identified by its chained hash, so a block held by an
instance implies nothing about its parent: `prefix_match` therefore counts, per instance,
only the blocks it holds contiguously from block 0, which is what a prefill can reuse.

A driver in the instances' own process (the simulator) may instead let the index `watch` each
instance's cache: a live view of the hashes it holds, read where a replayed copy would be kept.

A stored block's event may carry its retention on that instance (core/retention.py: a pin, a
cache_control TTL, a priority), in the conductor's clock; the index keeps it while the instance
holds the block and counts it only while live (`until > now`), so routing never counts on a
retention that has run out (`retained_match`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import takewhile

from kvpool.core.hashing import BlockHash
from kvpool.core.retention import Retention

POOL = "pool"


class GlobalKVIndex:
    """Per instance, the set of block hashes it holds. KV events arrive by the thousand blocks
    (a long prompt), so storing and evicting are whole-set operations; a prefix match walks
    only the instances holding block 0, each as far as it matches."""

    __slots__ = ("_held", "_retained", "_watched")

    def __init__(self) -> None:
        self._held: dict[str, AbstractSet[BlockHash]] = {}  # a set of replayed events, or a watched view
        self._retained: dict[str, dict[BlockHash, Retention]] = {}  # of held blocks only
        self._watched: set[str] = set()

    def watch(self, instance_id: str, held: AbstractSet[BlockHash]) -> None:
        """Read what `instance_id` holds from `held`, a live view of its cache, instead of replaying
        its stored and evicted events (its retention events still count). For a driver that
        delivers every instance's events before the next query, as the simulator does, the view is
        what replaying them in order would give; the two lists lose that order (a block evicted and
        registered again between two drains is in both), so replaying them can drop a block the
        cache holds. It also saves a second copy of every instance's hash table and the set
        updates that keep it: ~1.5 s of a 23 s trace-length simulation."""
        self._held[instance_id] = held
        self._watched.add(instance_id)

    def on_stored(self, instance_id: str, hashes: Iterable[BlockHash]) -> None:
        """`instance_id` now holds these blocks (re-storing a held block is a no-op)."""
        if instance_id not in self._watched:
            self._held.setdefault(instance_id, set()).update(hashes)  # type: ignore[attr-defined]

    def on_evicted(self, instance_id: str, hashes: Iterable[BlockHash]) -> None:
        """`instance_id` dropped these blocks; unknown blocks are ignored (events may race)."""
        held = self._held.get(instance_id)
        retained = self._retained.get(instance_id)
        if instance_id in self._watched:  # its view has dropped them, unless one was stored again since
            if retained:
                for h in hashes:
                    if h not in held:  # type: ignore[operator]
                        retained.pop(h, None)
            return
        if not held:
            return
        hashes = list(hashes)
        held.difference_update(hashes)  # type: ignore[attr-defined]
        if retained:
            for h in hashes:
                retained.pop(h, None)
        if not held:
            del self._held[instance_id]
            self._retained.pop(instance_id, None)

    def on_retention(self, instance_id: str, retention: Mapping[BlockHash, Retention | None]) -> None:
        """The retention of blocks `instance_id` holds (None: released); ones it does not hold
        (a racing eviction) are ignored."""
        held = self._held.get(instance_id, ())
        retained = self._retained.setdefault(instance_id, {})
        for h, r in retention.items():
            if r is not None and h in held:
                retained[h] = r
            else:
                retained.pop(h, None)
        if not retained:
            del self._retained[instance_id]

    def on_instance_down(self, instance_id: str) -> None:
        """Forget everything `instance_id` held: its memory is gone or unreachable."""
        self._held.pop(instance_id, None)
        self._retained.pop(instance_id, None)
        self._watched.discard(instance_id)

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

    def retained_match(self, hashes: Sequence[BlockHash], now: float) -> dict[str, int]:
        """For each instance retaining block 0 at `now`, how many leading blocks it holds
        under a live retention: the part of its prefix match it will not evict first."""
        runs = {inst: _live_run(retained, hashes, now) for inst, retained in self._retained.items()}
        return {inst: n for inst, n in runs.items() if n}

    def num_retained(self, instance_id: str, now: float) -> int:
        """How many blocks `instance_id` holds under a live retention at `now`."""
        return sum(r.until > now for r in self._retained.get(instance_id, {}).values())

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


def _live_run(retained: Mapping[BlockHash, Retention], hashes: Sequence[BlockHash], now: float) -> int:
    """How many of `hashes`, from the first, hold a retention live at `now`."""
    n = 0
    for h in hashes:
        r = retained.get(h)
        if r is None or r.until <= now:
            break
        n += 1
    return n
