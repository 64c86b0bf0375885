"""One attention type's share of the KV memory: what a layer group's block table needs.

A model's layers split into groups (kvpool/core/layer_groups.py), each with its own block table
per sequence over the one shared `BlockPool`. What differs between attention types lives here,
one class each, so the coordinator (kvpool/core/kv_manager.py) never asks which type a group is:
- `find_hit`: how far a prefix hit may reach, given what a holder (the device pool or a store)
  has of this group's blocks;
- `first_needed`: the first block a query at a hit point reads;
- `blocks_needed` / `table_end`: the blocks an admission takes;
- `free_behind`: the blocks no later query reads, given back as the sequence computes.
Full attention reads every block from the first and frees nothing early. A sliding window of W
tokens reads position c-W+1..c, so a hit at block k needs only the ceil((W-1)/B) blocks before
k, and a sequence holds at most ceil(W/B)+1 blocks there; freed table entries read NO_BLOCK.
Group g > 0 keys its blocks with the chained hash tagged with g (`group_key`), so the pool, the
store and the conductor's events tell groups apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.core.block_pool import BlockPool
from kvpool.core.hashing import BlockHash, key_bytes

NO_BLOCK = -1  # a table entry whose block a window group freed (never read: outside every window)
GROUP_TAG_BYTES = 2  # a group g > 0 key is its chained hash + g in these many bytes

# How many of the given keys, from the first, a holder (the device pool, a store) has whole.
Held = Callable[[Sequence[BlockHash]], int]


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The identity of layer group `group`'s block at `block_hash` (group 0: the hash itself)."""
    return key_bytes(block_hash) + group.to_bytes(GROUP_TAG_BYTES, "little") if group else block_hash


class FullAttentionGroup:
    """A group of full-attention layers: every query reads every block from the first."""

    window: int | None = None

    def __init__(self, index: int, pool: BlockPool) -> None:
        self.index = index
        self.pool = pool
        self.block_size = pool.block_size
        self.tag = group_key(b"", index)

    def keys(self, hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """This group's identities of the blocks named `hashes` (store keys, events)."""
        tag = self.tag
        return [key_bytes(h) + tag for h in hashes] if tag else hashes

    def first_needed(self, k: int) -> int:
        """The first block a query at a hit of `k` blocks reads."""
        return 0

    def find_hit(self, hashes: Sequence[BlockHash], floor: int, k: int, held: Held) -> int:
        """The largest k' in floor..k for which the holder has blocks floor..k'-1 (those before
        `floor` are there already)."""
        if k <= floor:
            return k
        return floor + held(self.keys(hashes[floor:k]))

    def table_end(self, num_tokens: int, cached: int, upto: int | None) -> int:
        """The tokens this group's table covers once a sequence of `num_tokens` is admitted."""
        return num_tokens

    def blocks_needed(self, num_tokens: int, cached: int, upto: int | None) -> int:
        """Blocks an admission with `cached` tokens hit takes beyond the hit's."""
        return -(-self.table_end(num_tokens, cached, upto) // self.block_size) - cached // self.block_size

    def max_blocks(self, prompt_len: int, total_len: int, chunk: int | None) -> int:
        """The most blocks a sequence growing to `total_len` ever holds here at once."""
        return -(-total_len // self.block_size)

    def free_behind(self, table: list[int], dead: int, num_computed_tokens: int) -> int:
        """Release the blocks no later query reads; returns the new count of freed leading entries."""
        return dead

    def reserve_needed(self, table: list[int], end: int, num_tokens: int) -> int:
        """Blocks `reserve` adds to reach token `end`: a full group's table is whole from admission."""
        return 0

    def reserve(self, table: list[int], end: int, num_tokens: int) -> None:
        """Grow the table to cover token `end` (nothing to do: see `reserve_needed`)."""


class SlidingWindowGroup(FullAttentionGroup):
    """A group of layers attending to the last `window` tokens: blocks behind the window are
    given back as the sequence computes, and a hit needs only the window before its point."""

    def __init__(self, index: int, pool: BlockPool, window: int) -> None:
        super().__init__(index, pool)
        self.window = window
        self.need = -(-(window - 1) // self.block_size)  # blocks the W-1 keys before a hit point span

    def first_needed(self, k: int) -> int:
        return max(0, k - self.need)

    def find_hit(self, hashes: Sequence[BlockHash], floor: int, k: int, held: Held) -> int:
        """The largest k' in floor..k whose window, blocks max(floor, k' - need)..k'-1, the
        holder has whole."""
        need = self.need
        while k > floor:
            start = max(floor, k - need)
            run = held(self.keys(hashes[start:k]))
            if run >= k - start:
                return k
            k = start + run  # every window over the missing block start + run fails: stop before it
        return k

    def table_end(self, num_tokens: int, cached: int, upto: int | None) -> int:
        """With `upto`, whole blocks up to that token (at least one past the hit): `reserve`
        adds the later chunks' blocks as they run."""
        if upto is None:
            return num_tokens
        B = self.block_size
        return min(num_tokens, -(-max(upto, cached + 1) // B) * B)

    def max_blocks(self, prompt_len: int, total_len: int, chunk: int | None) -> int:
        """The whole prompt at admission, or, allocated per prefill chunk of at most `chunk`
        tokens, the chunk and the window behind it; then at most need + 2 while decoding (the
        window, the block being written, one appended early)."""
        B = self.block_size
        prefill = -(-prompt_len // B)
        if chunk is not None:
            prefill = min(prefill, (self.window - 1 + chunk) // B + 2)
        return min(-(-total_len // B), max(prefill, self.need + 2))

    def free_behind(self, table: list[int], dead: int, num_computed_tokens: int) -> int:
        """Release the blocks wholly before position c - W + 1 (c: the next token to compute);
        registered ones stay cached (evictable), the rest become free."""
        end = max(0, (num_computed_tokens - self.window + 1) // self.block_size)
        if end <= dead:
            return dead
        self.pool.release(table[dead:end])
        table[dead:end] = [NO_BLOCK] * (end - dead)
        return end

    def reserve_needed(self, table: list[int], end: int, num_tokens: int) -> int:
        return max(0, -(-min(end, num_tokens) // self.block_size) - len(table))

    def reserve(self, table: list[int], end: int, num_tokens: int) -> None:
        B = self.block_size
        hi = -(-min(end, num_tokens) // B)
        if len(table) < hi:  # the blocks so far are full: only the last can be partial
            table.extend(self.pool.allocate(hi - len(table), min(num_tokens, hi * B) - len(table) * B))


Group = FullAttentionGroup  # every group manager has its interface


def make_groups(windows: Sequence[int | None], pool: BlockPool) -> list[Group]:
    """One group manager per layer group: full attention where the window is None."""
    return [FullAttentionGroup(g, pool) if w is None else SlidingWindowGroup(g, pool, w) for g, w in enumerate(windows)]


def longest_hit(groups: Sequence[Group], hashes: Sequence[BlockHash], floor: int, k: int, held: Held) -> int:
    """The largest k' in floor..k from which every group has what a query at k'*B reads: the
    full groups' runs first (each only shortens k), then the window groups until none moves it."""
    for g in groups:
        if g.window is None:
            k = g.find_hit(hashes, floor, k, held)
    windows = [g for g in groups if g.window is not None]
    settled = not windows
    while not settled and k > floor:
        settled = True
        for g in windows:
            fit = g.find_hit(hashes, floor, k, held)
            settled, k = settled and fit == k, fit
    return k
