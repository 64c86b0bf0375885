"""Swapping whole sequence groups between the device pool and host slots.

Preemption by swap is all or nothing per group, and a block shared by several of the group's
sequences (forks, beams) moves once: the plans list each block once, and its host slot takes one
reference per table that holds it. A window group's freed entries (NO_BLOCK) stay freed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvpool.core.block_pool import BlockPool
from kvpool.core.kv_groups import NO_BLOCK, Group
from kvpool.core.kv_records import SeqBlocks, SwapMap
from kvpool.errors import KVStateError, OutOfBlocks


class HostBlockPool:
    """Host-memory slots for swapped-out blocks: a free list and reference counts."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        block_id = self._free.pop()
        self.ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._free.append(block_id)


class SeqLookup(Protocol):
    def __call__(self, seq_id: int) -> SeqBlocks: ...


def unique_blocks(seq: SeqLookup, seq_ids: Iterable[int], on_host: bool) -> list[int]:
    """Every block the sequences hold, once, in table order (raises if one is on the other side)."""
    seen: dict[int, None] = {}
    for sid in seq_ids:
        s = seq(sid)
        if s.on_host != on_host:
            where = "host" if s.on_host else "device"
            raise KVStateError(f"sequence {sid} is already on the {where}")
        for t, d in zip(s.tables, s.dead, strict=True):
            seen.update(dict.fromkeys(t[d:]))
    return list(seen)


def swap_out(seqs: Sequence[SeqBlocks], unique: int, pool: BlockPool, host: HostBlockPool) -> SwapMap:
    """Move the sequences' blocks (`unique` distinct ones) to host slots, each shared block once."""
    if unique > host.num_free:
        raise OutOfBlocks(f"swap-out needs {unique} host blocks, only {host.num_free} are free")
    mapping: dict[int, int] = {NO_BLOCK: NO_BLOCK}
    for seq in seqs:
        for t, d in zip(seq.tables, seq.dead, strict=True):
            for b in t[d:]:
                if b in mapping:
                    host.incref(mapping[b])
                else:
                    mapping[b] = host.allocate()
            pool.release(reversed(t[d:]))
            t[:] = [mapping[b] for b in t]
        seq.on_host = True
    del mapping[NO_BLOCK]
    return list(mapping.items())


def swap_in(seqs: Sequence[SeqBlocks], unique: int, pool: BlockPool, host: HostBlockPool,
            groups: Sequence[Group]) -> SwapMap:
    """Bring the sequences' blocks (`unique` distinct ones) back to fresh device blocks and
    register the computed full ones again under each group's keys."""
    if unique > pool.num_free:
        raise OutOfBlocks(f"swap-in needs {unique} KV blocks, only {pool.num_free} are free")
    fresh = iter(pool.allocate(unique))
    mapping: dict[int, int] = {}
    B = pool.block_size
    for seq in seqs:
        for g, t, d in zip(groups, seq.tables, seq.dead, strict=True):
            for i in range(d, len(t)):
                hb = t[i]
                if hb in mapping:
                    pool.incref(mapping[hb])
                else:
                    mapping[hb] = db = next(fresh)
                    pool.add_tokens(db, min(B, seq.num_tokens - i * B))
                host.decref(hb)
            t[d:] = [mapping[hb] for hb in t[d:]]
            keys = g.keys(seq.hashes[d : seq.num_registered])
            for i, key in enumerate(keys, d):
                pool.register(t[i], key, seq.cache_salt)
        seq.on_host = False
    return list(mapping.items())
