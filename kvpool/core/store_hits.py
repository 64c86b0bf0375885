"""Hits in the external KV store, past the device prefix hit: which blocks to load, and what the
hit is worth once the loads landed.

Every layer group keeps its own blocks in the store under its own keys (`group_key`). A hit of k
blocks needs every full group's blocks from the device hit to k and every window group's last
ceil((W-1)/B) before k (those behind are never read), the same rule as a device hit
(`longest_hit`). A load may land short (a block missing or corrupt): the hit then settles at the
largest point every group still has whole, and the rest is computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.hashing import BlockHash
from kvpool.core.kv_groups import Group, Held, longest_hit


@dataclass(slots=True, frozen=True)
class StoreRange:
    """Group `group`'s blocks [start, end) of a sequence, to come from the external store."""

    group: int
    start: int
    end: int


def store_plan(groups: Sequence[Group], hashes: Sequence[BlockHash], hit_blocks: int, limit: int,
               lookup: Held) -> list[StoreRange]:
    """The blocks past a device hit of `hit_blocks` to load from a store (`lookup(keys)`: how
    many of `keys`, from the first, it holds) for the longest hit k <= `limit`. Empty when the
    store adds nothing."""
    k = min(limit, len(hashes))
    if k <= hit_blocks:
        return []
    k = longest_hit(groups, hashes, hit_blocks, k, lookup)
    if k <= hit_blocks:
        return []
    ranges = []
    for g in groups:
        start = max(hit_blocks, g.first_needed(k))
        if start < k:
            ranges.append(StoreRange(g.index, start, k))
    return ranges


def store_hit_blocks(hit_blocks: int, landed: Sequence[tuple[StoreRange, int]]) -> int:
    """What a store hit is worth once its loads landed (`landed`: each range and how many of
    its blocks, from the first, were read whole): the largest k from which every group has
    what a query at k*B reads, the device hit's `hit_blocks` at least."""
    k = max((r.end for r, _ in landed), default=hit_blocks)
    settled = False
    while not settled:
        settled = True
        for r, n in landed:
            if r.start == hit_blocks:
                fit = min(k, r.start + n)  # contiguous with the device hit: good up to its first miss
            elif n >= r.end - r.start and k >= r.end:
                fit = k  # a window group's last blocks, whole, for a hit at their end
            else:
                fit = hit_blocks  # a gap behind them: only the device hit's window is whole
            settled, k = settled and fit == k, min(k, fit)
    return k
