"""Per-sequence block tables over a BlockPool: PagedAttention's memory manager.

The scheduler asks; this module decides which physical blocks hold which tokens and
returns the data movements (copy-on-write copies, swap plans) for a driver to perform.
Contract (see docs/architecture.md):
- a prompt of L tokens takes ceil(L/B) blocks, a decode token a new block only when the
  last one is full, so a sequence never wastes more than B-1 slots;
- `fork` shares every block; the first write into a shared, partially filled last block
  copies it (one CopyOp), the last holder writes in place;
- full blocks are registered by chained hash once their KV is computed (`commit`), stay
  cached after their sequence ends, and are reused from the first block on by later
  prompts, which always recompute at least their last prompt token;
- every failed operation raises before changing any state.
Layer groups (kvpool/core/layer_groups.py): one block table per group, all over one shared
pool. A group of window W frees, on `commit`, every block wholly before the window of the next
token to compute (position c needs c-W+1..c), so a sequence holds at most ceil(W/B)+1 blocks
there; freed entries read NO_BLOCK. A prefix hit of k blocks needs every full group's blocks
0..k-1 and every window group's last ceil((W-1)/B) blocks before k. Group g > 0 registers its
blocks under the chained hash tagged with g (`group_key`), so store keys and events tell groups
apart. The tiered store holds each group's blocks under those keys; `store_plan` picks the blocks
a store hit needs (a window group's last ceil((W-1)/B) only) and `store_hit_blocks` what a hit
is worth once the loads landed (a failed block is recomputed, with what its window needs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.core.block_pool import BlockPool, KVEvents
from kvpool.core.hashing import BlockHash, hash_blocks, root_hash
from kvpool.errors import ConfigError, KVStateError, OutOfBlocks, UnknownSequence

NO_BLOCK = -1  # a table entry whose block a window group freed (never read: outside every window)
CopyOp = tuple[int, int]  # (src block, dst block), device to device
SwapMap = list[tuple[int, int]]  # (src block, dst block) across device and host
GROUP_TAG_BYTES = 2  # a group g > 0 key is its chained hash + g in these many bytes


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The identity of layer group `group`'s block at `block_hash` (group 0: the hash itself)."""
    return block_hash + group.to_bytes(GROUP_TAG_BYTES, "little") if group else block_hash


@dataclass(slots=True, frozen=True)
class StoreRange:
    """Group `group`'s blocks [start, end) of a sequence, to come from the external store."""

    group: int
    start: int
    end: int


@dataclass(slots=True)
class SeqBlocks:
    """What the manager keeps per sequence."""

    blocks: list[int]
    num_tokens: int
    cache_salt: str | None
    hashes: list[BlockHash] = field(default_factory=list)
    num_registered: int = 0
    on_host: bool = False
    tables: list[list[int]] = field(default_factory=list)  # per layer group; tables[0] is blocks
    dead: list[int] = field(default_factory=list)  # per group: leading entries freed (NO_BLOCK)

    def __post_init__(self) -> None:
        if not self.tables:
            self.tables = [self.blocks]
        if not self.dead:
            self.dead = [0] * len(self.tables)


@dataclass(slots=True, frozen=True)
class PrefixHit:
    block_ids: tuple[int, ...]  # group 0's hit blocks (NO_BLOCK where a window group needs none)
    num_tokens: int
    idle_blocks: int = 0  # of the hit's blocks, those at ref_count 0 (cached, evictable) when matched
    other_groups: tuple[tuple[int, ...], ...] = ()  # the same for groups 1.. of a layer-grouped model

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        return (self.block_ids, *self.other_groups)


@dataclass(slots=True)
class PrefixCacheStats:
    queries_tokens: int = 0
    hits_tokens: int = 0
    queries_blocks: int = 0
    hits_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else 0.0


@dataclass(slots=True, frozen=True)
class KVUsage:
    """Where the device's KV slots are at one instant."""

    total_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    token_slots: int

    @property
    def allocated_slots(self) -> int:
        return self.used_blocks * self.block_size

    @property
    def empty_slots(self) -> int:
        """Allocated but not (yet) holding a token: at most B-1 per sequence."""
        return self.allocated_slots - self.token_slots

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks

    @property
    def token_fraction_of_allocated(self) -> float:
        return self.token_slots / self.allocated_slots if self.used_blocks else 1.0


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


class KVCacheManager:
    """Block tables, prefix reuse, copy-on-write and swap plans for one device pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
        num_host_blocks: int = 0,
        namespace: str = "",
        record_events: bool = False,
        group_windows: Sequence[int | None] = (None,),
    ) -> None:
        if num_host_blocks < 0:
            raise ConfigError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ConfigError(f"group_windows must be one window (>= 1 token, or None) per group, got {group_windows}")
        self.pool = BlockPool(num_blocks, block_size, eviction_policy, enable_prefix_caching, record_events)
        self.host = HostBlockPool(num_host_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        self._root = root_hash(namespace)
        self.seqs: dict[int, SeqBlocks] = {}
        self.stats = PrefixCacheStats()
        self.num_cow_copies = 0
        self.group_windows: tuple[int | None, ...] = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.windowed = any(w is not None for w in self.group_windows)
        self._tags = [b""] + [group_key(b"", g) for g in range(1, self.num_groups)]

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def seq(self, seq_id: int) -> SeqBlocks:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id} is not allocated (never allocated, or already freed)") from None

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks in order (group 0's; the live list: valid until its next change)."""
        return self.seq(seq_id).blocks

    def block_tables(self, seq_id: int) -> list[list[int]]:
        """Every layer group's table (NO_BLOCK where a window group freed the block)."""
        return self.seq(seq_id).tables

    def blocks_held(self, seq_id: int) -> list[int]:
        """Blocks the sequence holds now, per layer group (freed window blocks excluded)."""
        seq = self.seq(seq_id)
        return [len(t) - d for t, d in zip(seq.tables, seq.dead, strict=True)]

    def max_blocks(self, prompt_len: int, total_len: int, chunk: int | None = None) -> int:
        """The most blocks a sequence of `prompt_len` prompt tokens growing to `total_len` ever
        holds at once, over all groups. A window group takes the whole prompt at admission, or,
        allocated per prefill chunk of at most `chunk` tokens (`allocate(upto=...)`, `reserve`),
        the chunk and the window behind it; then at most ceil((W-1)/B) + 2 while decoding (the
        window, the block being written, one appended early)."""
        B = self.block_size
        full = -(-total_len // B)
        n = 0
        for w in self.group_windows:
            if w is None:
                n += full
                continue
            prefill = -(-prompt_len // B)
            if chunk is not None:
                prefill = min(prefill, (w - 1 + chunk) // B + 2)
            n += min(full, max(prefill, -(-(w - 1) // B) + 2))
        return n

    def last_block_shared(self, seq_id: int) -> bool:
        """The sequence's last block is partly filled and shared: its next write copies it."""
        seq = self.seq(seq_id)
        return bool(seq.num_tokens % self.block_size) and self.pool.ref_counts[seq.blocks[-1]] > 1

    def prompt_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None, limit: int | None = None
    ) -> list[BlockHash]:
        """Chained hashes of the full blocks of `token_ids` (at most `limit` of them)."""
        return hash_blocks(token_ids, self.block_size, cache_salt=cache_salt, parent=self._root, limit=limit)

    def match_prefix(self, hashes: Sequence[BlockHash], num_prompt_tokens: int) -> PrefixHit:
        """Longest run of cached blocks from block 0, leaving the last prompt token to compute."""
        if not self.enable_prefix_caching:
            return PrefixHit((), 0)
        limit = (num_prompt_tokens - 1) // self.block_size
        if not self.windowed and self.num_groups == 1:
            found = self.pool.lookup_run(hashes, limit)
            return PrefixHit(tuple(found), len(found) * self.block_size, self.pool.count_idle(found))
        return self._match_groups(hashes, limit)

    def _match_groups(self, hashes: Sequence[BlockHash], limit: int) -> PrefixHit:
        """The hit of k blocks, k the largest where every full group holds blocks 0..k-1 and
        every window group the ceil((W-1)/B) blocks before k (all that a query at k*B reads)."""
        k = min(limit, len(hashes))
        for g, w in enumerate(self.group_windows):
            if w is None:
                k = len(self.pool.lookup_run(self._tagged(hashes[:k], g), k))
        settled = False
        while not settled:
            settled = True
            for g, w in enumerate(self.group_windows):
                if w is not None:
                    fit = self._window_fit(hashes, g, self._window_blocks(w), 0, k, self._pool_run)
                    settled, k = settled and fit == k, fit
        lookup = self.pool.lookup
        tables = []
        for g, w in enumerate(self.group_windows):
            tag = self._tags[g]
            first = 0 if w is None else max(0, k - self._window_blocks(w))
            ids = [lookup(h + tag) for h in hashes[first:k]]
            tables.append((NO_BLOCK,) * first + tuple(ids))  # type: ignore[arg-type]
        live = [b for t in tables for b in t if b != NO_BLOCK]
        return PrefixHit(tables[0], k * self.block_size, self.pool.count_idle(live), tuple(tables[1:]))

    def _window_blocks(self, window: int) -> int:
        """Cached blocks a window group needs before a hit point: the W-1 keys a query reads."""
        return -(-(window - 1) // self.block_size)

    def _window_fit(self, hashes: Sequence[BlockHash], group: int, need: int, floor: int, k: int,
                    held: Callable[[Sequence[BlockHash]], int]) -> int:
        """The largest k' in floor..k whose window, blocks max(floor, k' - need)..k'-1 of `group`,
        a holder has whole (`held(keys)`: how many of `keys`, from the first, it holds): the
        device pool for a prefix hit (floor 0), a store for the blocks past one."""
        while k > floor:
            start = max(floor, k - need)
            run = held(self._tagged(hashes[start:k], group))
            if run >= k - start:
                return k
            k = start + run  # every window over the missing block start + run fails: stop before it
        return k

    def _pool_run(self, keys: Sequence[BlockHash]) -> int:
        return len(self.pool.lookup_run(keys, len(keys)))

    def _tagged(self, hashes: Sequence[BlockHash], group: int) -> Sequence[BlockHash]:
        tag = self._tags[group]
        return [h + tag for h in hashes] if tag else hashes

    def group_keys(self, hashes: Sequence[BlockHash], group: int) -> list[BlockHash]:
        """Group `group`'s identities of the blocks named `hashes` (store keys, events)."""
        return list(self._tagged(hashes, group))

    # -- the external store ---------------------------------------------------------------
    def store_plan(
        self, hashes: Sequence[BlockHash], hit_blocks: int, limit: int, lookup: Callable[[Sequence[BlockHash]], int]
    ) -> list[StoreRange]:
        """The blocks past a device hit of `hit_blocks` to load from a store (`lookup(keys)`: how
        many of `keys`, from the first, it holds) for the longest hit k <= `limit`: every full
        group's blocks hit..k-1, every window group's last ceil((W-1)/B) before k (those behind
        are never read). Empty when the store adds nothing."""
        k = min(limit, len(hashes))
        if k <= hit_blocks:
            return []
        for g, w in enumerate(self.group_windows):
            if w is None and k > hit_blocks:
                k = hit_blocks + lookup(self._tagged(hashes[hit_blocks:k], g))
        settled = False
        while not settled and k > hit_blocks:
            settled = True
            for g, w in enumerate(self.group_windows):
                if w is not None:
                    fit = self._window_fit(hashes, g, self._window_blocks(w), hit_blocks, k, lookup)
                    settled, k = settled and fit == k, fit
        if k <= hit_blocks:
            return []
        ranges = []
        for g, w in enumerate(self.group_windows):
            start = hit_blocks if w is None else max(hit_blocks, k - self._window_blocks(w))
            if start < k:
                ranges.append(StoreRange(g, start, k))
        return ranges

    def store_hit_blocks(self, hit_blocks: int, landed: Sequence[tuple[StoreRange, int]]) -> int:
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

    def drop_behind(self, seq_id: int, num_computed_tokens: int) -> None:
        """A store hit settled at `num_computed_tokens`: free the window groups' blocks behind
        its window now, unregistered (those the store did not fill hold no KV)."""
        seq = self.seq(seq_id)
        if self.windowed and not seq.on_host:
            self._free_behind(seq, num_computed_tokens)

    def blocks_needed(self, num_tokens: int, hit: PrefixHit, upto: int | None = None) -> int:
        """New blocks an `allocate` of `num_tokens` with this prefix hit (and `upto`) takes from
        the free pool (cached hit blocks that are evictable leave the free pool too)."""
        B = self.block_size
        hit_blocks = hit.num_tokens // B if self.windowed or self.num_groups > 1 else len(hit.block_ids)
        total = -(-num_tokens // B)
        windowed = -(-self._window_end(num_tokens, hit.num_tokens, upto) // B)
        new = sum((total if w is None else windowed) - hit_blocks for w in self.group_windows)
        return new + hit.idle_blocks

    def _window_end(self, num_tokens: int, cached: int, upto: int | None) -> int:
        """The tokens a window group's table covers at admission: whole blocks up to `upto` (at
        least one past the hit), or all of them."""
        if upto is None or not self.windowed:
            return num_tokens
        B = self.block_size
        return min(num_tokens, -(-max(upto, cached + 1) // B) * B)

    def window_blocks_needed(self, seq_id: int, end: int) -> int:
        """New blocks `reserve(seq_id, end)` takes: the window groups' blocks up to token `end`
        not allocated yet."""
        seq = self.seq(seq_id)
        hi = -(-min(end, seq.num_tokens) // self.block_size)
        return sum(max(0, hi - len(t)) for t, w in zip(seq.tables, self.group_windows, strict=True) if w is not None)

    def reserve(self, seq_id: int, end: int) -> None:
        """Give the window groups slots up to token `end` (the end of the prefill chunk about to
        run): a sequence allocated with `upto` holds window blocks only for the chunks so far,
        and those behind the window are freed as chunks commit."""
        need = self.window_blocks_needed(seq_id, end)
        if not need:
            return
        if need > self.pool.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} KV blocks for its next chunk, "
                              f"only {self.pool.num_free} are free")
        seq = self.seqs[seq_id]
        if seq.on_host:
            raise KVStateError(f"sequence {seq_id} is swapped out; swap it in first")
        B = self.block_size
        hi = -(-min(end, seq.num_tokens) // B)
        for t, w in zip(seq.tables, self.group_windows, strict=True):
            if w is not None and len(t) < hi:  # the blocks so far are full: only the last can be partial
                t.extend(self.pool.allocate(hi - len(t), min(seq.num_tokens, hi * B) - len(t) * B))

    def append_blocks_needed(self, seq_id: int, num_new_tokens: int = 1) -> int:
        seq = self.seq(seq_id)
        B = self.block_size
        need = -(-(seq.num_tokens + num_new_tokens) // B) - len(seq.blocks)
        if self.num_groups > 1:
            need *= self.num_groups
        if seq.num_tokens % B:
            ref = self.pool.ref_counts
            for t in seq.tables:
                if ref[t[-1]] > 1:
                    need += 1  # copy-on-write of the shared partial last block
        return need

    def usage(self) -> KVUsage:
        pool = self.pool
        free = pool.num_free
        return KVUsage(
            total_blocks=pool.num_blocks,
            block_size=self.block_size,
            used_blocks=pool.num_blocks - free,
            free_blocks=free,
            cached_blocks=pool.num_cached_evictable,
            token_slots=pool.tokens_in_use,
        )

    # -- allocation ------------------------------------------------------------------------
    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
        hit: PrefixHit | None = None,
        upto: int | None = None,
    ) -> int:
        """Give a new sequence slots for all of `token_ids`, reusing the longest cached
        prefix. Returns the number of tokens whose KV is already there (cached). `hit` is
        `match_prefix(block_hashes, len(token_ids))` when the caller has just taken it, with no
        change to this manager since (it saves walking a long prompt twice). With `upto`, window
        groups get slots only up to that token (rounded up to a block; `reserve` adds the rest
        chunk by chunk)."""
        if seq_id in self.seqs:
            raise KVStateError(f"sequence {seq_id} is already allocated")
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise KVStateError(f"sequence {seq_id} has no tokens to allocate")
        if block_hashes is None:
            block_hashes = self.prompt_hashes(token_ids, cache_salt) if self.enable_prefix_caching else []
        if hit is None:
            hit = self.match_prefix(block_hashes, num_tokens)
        need = self.blocks_needed(num_tokens, hit, upto)
        if need > self.pool.num_free:
            raise OutOfBlocks(
                f"sequence {seq_id} needs {need} KV blocks for {num_tokens} tokens, "
                f"only {self.pool.num_free} of {self.pool.num_blocks} are free"
            )
        B = self.block_size
        num_hit = hit.num_tokens // B
        window_end = self._window_end(num_tokens, hit.num_tokens, upto)
        ends = [num_tokens if w is None else window_end for w in self.group_windows]
        hits = hit.tables if self.num_groups > 1 or self.windowed else (hit.block_ids,)
        for hit_ids in hits:  # every group's hit first: a new block must not evict another group's
            self.pool.incref_all([b for b in hit_ids if b != NO_BLOCK] if self.windowed else hit_ids)
        tables = [list(hit_ids) + self.pool.allocate(-(-end // B) - num_hit, end - num_hit * B)
                  for hit_ids, end in zip(hits, ends[: len(hits)], strict=True)]
        for end in ends[len(tables):]:  # no hit: the other groups start empty
            tables.append(self.pool.allocate(-(-end // B), end))
        dead = [t.count(NO_BLOCK) for t in tables] if self.windowed else None
        self.seqs[seq_id] = SeqBlocks(
            tables[0], num_tokens, cache_salt, list(block_hashes), num_hit, tables=tables, dead=dead or []
        )
        st = self.stats
        st.queries_tokens += num_tokens
        st.hits_tokens += hit.num_tokens
        st.queries_blocks += num_tokens // B
        st.hits_blocks += num_hit
        return hit.num_tokens

    def append_slots(self, seq_id: int, num_new_tokens: int = 1) -> list[CopyOp]:
        """Reserve slots for `num_new_tokens` more tokens; returns the copies to perform
        before writing (copy-on-write of a shared partial last block)."""
        seq = self.seqs.get(seq_id) or self.seq(seq_id)  # one call fewer per decode token
        B = self.block_size
        fill = seq.num_tokens % B
        if fill and fill + num_new_tokens <= B and not seq.on_host:
            ref = self.pool.ref_counts
            if self.num_groups == 1:
                last = seq.blocks[-1]
                if ref[last] == 1:  # the common decode step: room in a private last block
                    self.pool.add_tokens(last, num_new_tokens)
                    seq.num_tokens += num_new_tokens
                    return []
            elif all(ref[t[-1]] == 1 for t in seq.tables):
                for t in seq.tables:
                    self.pool.add_tokens(t[-1], num_new_tokens)
                seq.num_tokens += num_new_tokens
                return []
        if seq.on_host:
            raise KVStateError(f"sequence {seq_id} is swapped out; swap it in first")
        need = self.append_blocks_needed(seq_id, num_new_tokens)
        if need > self.pool.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} more KV blocks, only {self.pool.num_free} are free")
        copies: list[CopyOp] = []
        for table in seq.tables:
            self._grow(table, fill, num_new_tokens, copies)
        seq.num_tokens += num_new_tokens
        return copies

    def _grow(self, table: list[int], fill: int, num_new_tokens: int, copies: list[CopyOp]) -> None:
        """Extend one group's table by `num_new_tokens` slots (its last block holds `fill`)."""
        B = self.block_size
        if fill:
            last = table[-1]
            if self.pool.ref_counts[last] > 1:
                (new,) = self.pool.allocate(1)
                self.pool.add_tokens(new, fill)
                self.pool.decref(last)
                table[-1] = new
                copies.append((last, new))
                self.num_cow_copies += 1
            take = min(B - fill, num_new_tokens)
            self.pool.add_tokens(table[-1], take)
            remaining = num_new_tokens - take
        else:
            remaining = num_new_tokens
        if remaining:
            table.extend(self.pool.allocate(-(-remaining // B), remaining))

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """The KV of the first `num_computed_tokens` tokens is written: register the full blocks,
        then free the window groups' blocks no later query reads."""
        seq = self.seq(seq_id)
        if self.enable_prefix_caching:
            self._register(seq, token_ids, num_computed_tokens)
        if self.windowed and not seq.on_host:
            self._free_behind(seq, num_computed_tokens)

    def _register(self, seq: SeqBlocks, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        B = self.block_size
        full = min(num_computed_tokens, seq.num_tokens) // B
        if seq.num_registered >= full:
            return
        hashes = seq.hashes
        if len(hashes) < full:  # hash the blocks filled since (decode, partial prompt tail)
            i = len(hashes)
            hashes += hash_blocks(token_ids, B, cache_salt=seq.cache_salt, parent=hashes[-1] if i else self._root,
                                  start_block=i, limit=full)
        start = seq.num_registered
        for g, table in enumerate(seq.tables):
            ids, hs = table[start:full], self._tagged(hashes[start:full], g)
            if seq.dead[g] > start:  # freed window blocks have nothing to register
                skip = seq.dead[g] - start
                ids, hs = ids[skip:], hs[skip:]
            self.pool.register_many(ids, hs, seq.cache_salt)
        seq.num_registered = full

    def _free_behind(self, seq: SeqBlocks, num_computed_tokens: int) -> None:
        """Release each window group's blocks wholly before position c - W + 1 (c: the next
        token to compute); registered ones stay cached (evictable), the rest become free."""
        B = self.block_size
        for g, w in enumerate(self.group_windows):
            if w is None:
                continue
            end = max(0, (num_computed_tokens - w + 1) // B)
            start = seq.dead[g]
            if end > start:
                table = seq.tables[g]
                self.pool.release(table[start:end])
                table[start:end] = [NO_BLOCK] * (end - start)
                seq.dead[g] = end

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (no copy until a write)."""
        parent = self.seq(parent_id)
        if child_id in self.seqs:
            raise KVStateError(f"sequence {child_id} is already allocated")
        if parent.on_host:
            raise KVStateError(f"sequence {parent_id} is swapped out; cannot fork it")
        for t, d in zip(parent.tables, parent.dead, strict=True):
            self.pool.incref_all(t[d:])
        tables = [list(t) for t in parent.tables]
        self.seqs[child_id] = SeqBlocks(
            tables[0], parent.num_tokens, parent.cache_salt, list(parent.hashes), parent.num_registered,
            tables=tables, dead=list(parent.dead),
        )

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks, tail first so the least shareable are evicted first."""
        seq = self.seq(seq_id)
        del self.seqs[seq_id]
        for t, d in zip(seq.tables, seq.dead, strict=True):
            live = t[d:] if d else t
            if seq.on_host:
                for b in reversed(live):
                    self.host.decref(b)
            else:
                self.pool.release(reversed(live))

    def reset_prefix_cache(self, owned: Callable[[str | None], bool] | None = None) -> int:
        """Evict every cached block not in use, or only those whose cache_salt `owned` accepts."""
        return self.pool.evict_all_cached() if owned is None else self.pool.evict_cached_where(owned)

    def drain_events(self) -> KVEvents:
        return self.pool.drain_events()

    # -- swapping --------------------------------------------------------------------------
    def _unique_blocks(self, seq_ids: Iterable[int], on_host: bool) -> list[int]:
        seen: dict[int, None] = {}
        for sid in seq_ids:
            seq = self.seq(sid)
            if seq.on_host != on_host:
                where = "host" if seq.on_host else "device"
                raise KVStateError(f"sequence {sid} is already on the {where}")
            for t, d in zip(seq.tables, seq.dead, strict=True):
                seen.update(dict.fromkeys(t[d:]))
        return list(seen)

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        return len(self._unique_blocks(seq_ids, on_host=False)) <= self.host.num_free

    def can_swap_in(self, seq_ids: Iterable[int]) -> bool:
        return self.num_swap_in_blocks(seq_ids) <= self.pool.num_free

    def num_swap_in_blocks(self, seq_ids: Iterable[int]) -> int:
        """Device blocks swapping these host-resident sequences in takes (shared blocks once)."""
        return len(self._unique_blocks(seq_ids, on_host=True))

    def swap_out(self, seq_ids: Sequence[int]) -> SwapMap:
        """Move a whole group to host slots, each shared block once; all or nothing."""
        unique = self._unique_blocks(seq_ids, on_host=False)
        if len(unique) > self.host.num_free:
            raise OutOfBlocks(f"swap-out needs {len(unique)} host blocks, only {self.host.num_free} are free")
        mapping: dict[int, int] = {NO_BLOCK: NO_BLOCK}
        for sid in seq_ids:
            seq = self.seqs[sid]
            for t, d in zip(seq.tables, seq.dead, strict=True):
                for b in t[d:]:
                    if b in mapping:
                        self.host.incref(mapping[b])
                    else:
                        mapping[b] = self.host.allocate()
                self.pool.release(reversed(t[d:]))
                t[:] = [mapping[b] for b in t]
            seq.on_host = True
        del mapping[NO_BLOCK]
        return list(mapping.items())

    def swap_in(self, seq_ids: Sequence[int]) -> SwapMap:
        """Bring a swapped group back to fresh device blocks; all or nothing."""
        unique = self._unique_blocks(seq_ids, on_host=True)
        if len(unique) > self.pool.num_free:
            raise OutOfBlocks(f"swap-in needs {len(unique)} KV blocks, only {self.pool.num_free} are free")
        fresh = iter(self.pool.allocate(len(unique)))
        mapping: dict[int, int] = {}
        B = self.block_size
        for sid in seq_ids:
            seq = self.seqs[sid]
            for g, (t, d) in enumerate(zip(seq.tables, seq.dead, strict=True)):
                for i in range(d, len(t)):
                    hb = t[i]
                    if hb in mapping:
                        self.pool.incref(mapping[hb])
                    else:
                        mapping[hb] = db = next(fresh)
                        self.pool.add_tokens(db, min(B, seq.num_tokens - i * B))
                    self.host.decref(hb)
                t[d:] = [mapping[hb] for hb in t[d:]]
                tag = self._tags[g]
                for i in range(d, seq.num_registered):
                    self.pool.register(t[i], seq.hashes[i] + tag, seq.cache_salt)
            seq.on_host = False
        return list(mapping.items())
