"""Physical KV blocks: reference counts, the free list, and the prefix cache's hash map.

A block is in exactly one of three states:
  in use     ref_count > 0, referenced by that many block tables;
  cached     ref_count == 0 and registered under a hash: its KV is valid and reusable, and
             it sits in the eviction policy's order until memory is needed;
  free       ref_count == 0, no hash: in the free list.
Allocation takes free blocks first and evicts cached blocks in policy order only when
the free list is empty. Every operation is O(1) per block.

Per-block state is three lists indexed by block id (reference counts, tokens held, hashes)
rather than an object per block: a simulated cluster holds millions of blocks and moves
thousands per request, and lists of small ints are compact and cheap to walk. `blocks` gives
read-only `Block` snapshots for inspection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, KeysView, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import islice, takewhile
from operator import is_not
from typing import overload

from kvpool.core.hashing import BlockHash
from kvpool.core.policies import EvictionPolicy, make_policy
from kvpool.core.retention import Retention, RetentionTable
from kvpool.errors import ConfigError, KVStateError, OutOfBlocks

MAX_BLOCK_SIZE = 2048  # Mooncake hashes its trace in 512-token blocks
_found = partial(is_not, None)


@dataclass(slots=True, frozen=True)
class Block:
    """One block's state at the moment it was read."""

    block_id: int
    ref_count: int = 0
    num_tokens: int = 0
    block_hash: BlockHash | None = None


@dataclass(slots=True)
class KVEvents:
    """Hashes registered and evicted since the last drain, for the conductor's global index."""

    stored: list[BlockHash] = field(default_factory=list)
    evicted: list[BlockHash] = field(default_factory=list)
    evicted_block_ids: list[int] = field(default_factory=list)  # where each evicted hash lived
    # live retention of stored blocks, and of cached ones whose retention changed (None: released)
    retention: dict[BlockHash, Retention | None] = field(default_factory=dict)


class BlockView(Sequence[Block]):
    """A pool's blocks as read-only snapshots: `pool.blocks[i]`, `for b in pool.blocks`."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_blocks

    @overload
    def __getitem__(self, i: int) -> Block: ...

    @overload
    def __getitem__(self, i: slice) -> list[Block]: ...

    def __getitem__(self, i: int | slice) -> Block | list[Block]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        p = self._pool
        block_id = range(p.num_blocks)[i]
        return Block(block_id, p.ref_counts[block_id], p.block_tokens[block_id], p.block_hashes[block_id])


class BlockPool:
    """`num_blocks` blocks of `block_size` slots on one device."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eviction_policy: str = "lru",
        enable_caching: bool = True,
        record_events: bool = False,
    ) -> None:
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {block_size}")
        if num_blocks < 1:
            raise ConfigError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_tokens: list[int] = [0] * num_blocks  # slots holding (or reserved for) a token
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.block_salts: dict[int, str] = {}  # the cache_salt of each hashed block registered under one
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields block 0 first
        self._evictable: EvictionPolicy = make_policy(eviction_policy, num_blocks)
        self._cached: dict[BlockHash, int] = {}
        self._tokens_in_use = 0
        self.events = KVEvents() if record_events else None
        self.num_evictions = 0
        self.retention: RetentionTable | None = None  # set once a block is retained (core/retention.py)

    # -- queries ---------------------------------------------------------------------------
    @property
    def blocks(self) -> BlockView:
        return BlockView(self)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free plus cached-evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_evictable(self) -> int:
        return len(self._evictable)

    @property
    def tokens_in_use(self) -> int:
        """Slots of in-use blocks that hold (or are reserved for) a known token."""
        return self._tokens_in_use

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def lookup_run(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the first (at most
        `max_blocks`): a prefix hit, walked at C speed because prompts span thousands of blocks."""
        return list(takewhile(_found, map(self._cached.get, islice(hashes, max_blocks))))

    def count_idle(self, block_ids: Iterable[int]) -> int:
        """How many of `block_ids` are at ref_count 0 (cached and evictable)."""
        return list(map(self.ref_counts.__getitem__, block_ids)).count(0)

    def cached_items(self) -> list[tuple[BlockHash, int]]:
        return list(self._cached.items())

    def cached_hashes(self) -> KeysView[BlockHash]:
        """The hashes of every block cached now, in use or not: a live, read-only view."""
        return self._cached.keys()

    # -- mutations -------------------------------------------------------------------------
    def allocate(self, n: int, num_tokens: int = 0, *, by_id: bool = True) -> list[int]:
        """Take `n` blocks at ref_count 1, free ones first, then evicting cached blocks in
        policy order (handed out by id, or in eviction order without `by_id`: as `n` calls for
        one block each would). They hold `num_tokens` tokens, `block_size` per block from the first."""
        out = self._take(n, by_id)
        ref, tokens = self.ref_counts, self.block_tokens
        B, left = self.block_size, num_tokens
        for b in out:
            ref[b] = 1
            tokens[b] = fill = B if left >= B else left
            left -= fill
        self._tokens_in_use += num_tokens - left
        return out

    def _take(self, n: int, by_id: bool = True) -> list[int]:
        """`n` blocks out of the free list (in pop() order), then evicted in policy order and
        handed out in id order (`by_id`). The policy picks the victims; which id holds which
        table position is nobody's, and ids in order keep a table's blocks neighbours in every
        per-block list (in eviction order they scatter as a run goes on, and a long simulation
        slowed down copy after copy: docs/performance.md, 2026-12-05 21:22)."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, only {self.num_free} of {self.num_blocks} are free")
        free = self._free
        take = min(n, len(free))
        out = free[len(free) - take :]
        del free[len(free) - take :]
        out.reverse()  # the order pop() would give
        if take < n:
            ret = self.retention
            retained = None if ret is None else ret.pick(self._evictable, n - take, self.block_hashes)
            victims = self._evict(n - take, retained)
            out.extend(sorted(victims) if by_id else victims)
            self.num_evictions += n - take
        return out

    def incref(self, block_id: int) -> None:
        self.incref_all((block_id,))

    def incref_all(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block; cached ones leave the eviction order."""
        ref, tokens, hashes = self.ref_counts, self.block_tokens, self.block_hashes
        idle: list[int] = []
        revived = 0
        try:
            for b in block_ids:
                rc = ref[b]
                if rc == 0:
                    if hashes[b] is None:
                        raise KVStateError(f"block {b} is free; allocate it instead of sharing it")
                    idle.append(b)
                    revived += tokens[b]
                ref[b] = rc + 1
        finally:
            self._tokens_in_use += revived
            self._evictable.remove_many(idle)

    def decref(self, block_id: int) -> None:
        self.release((block_id,))

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in order: a block reaching 0 becomes cached
        (evictable, in this order) if it has a hash, else free."""
        ref, tokens, hashes, free = self.ref_counts, self.block_tokens, self.block_hashes, self._free
        cached: list[int] = []
        released = 0
        try:
            for b in block_ids:
                rc = ref[b]
                if rc == 1:
                    ref[b] = 0
                    released += tokens[b]
                    if hashes[b] is not None:
                        cached.append(b)
                    else:
                        tokens[b] = 0
                        free.append(b)
                elif rc > 1:
                    ref[b] = rc - 1
                else:
                    raise KVStateError(f"block {b} is already free (double free)")
        finally:
            self._tokens_in_use -= released
            self._evictable.insert_new(cached)  # each was in use until now: none is evictable

    def add_tokens(self, block_id: int, n: int) -> None:
        """Record `n` more slots of an in-use block as holding tokens."""
        self.block_tokens[block_id] += n
        self._tokens_in_use += n

    def register(self, block_id: int, block_hash: BlockHash, salt: str | None = None) -> bool:
        """Make a full in-use block findable by its hash; False when another block already
        holds that content (the duplicate then stays private and is freed normally)."""
        if not self.enable_caching:
            return False
        current = self.block_hashes[block_id]
        if current is not None or block_hash in self._cached:
            return current == block_hash
        self.block_hashes[block_id] = block_hash
        if salt is not None:
            self.block_salts[block_id] = salt
        self._cached[block_hash] = block_id
        if self.events is not None:
            self.events.stored.append(block_hash)
        return True

    def register_many(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], salt: str | None = None) -> None:
        """`register` each block under the hash at the same position."""
        if not self.enable_caching:
            return
        current, salts = self.block_hashes, self.block_salts
        stored = self.events.stored if self.events is not None else None
        setdefault = self._cached.setdefault
        for b, h in zip(block_ids, hashes, strict=True):
            # an unregistered block is in no entry, so setdefault returns b only if h was new
            if current[b] is None and setdefault(h, b) is b:
                current[b] = h
                if salt is not None:
                    salts[b] = salt
                if stored is not None:
                    stored.append(h)

    def cache_received(self, hits: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Blocks computed elsewhere and named `hashes` land in the cache after the cached blocks
        `hits` (their prefix), leaving the pool exactly as a sequence holding them would
        (core/receive.py): `incref_all(hits)`, `allocate(len(hashes) + 1)`, `register_many` of
        all but the last new block, then `release` of the whole table, last block first. One pass
        over the new blocks instead of four: the same blocks taken, the same victims and events,
        the same eviction order; only the reference counts' round trip is skipped. Received blocks
        carry no cache salt (the salt is in their hashes already)."""
        ref, tokens, current = self.ref_counts, self.block_tokens, self.block_hashes
        idle = [b for b in dict.fromkeys(hits) if ref[b] == 0]  # a content named twice is one block
        self._evictable.remove_many(idle)  # in use while the new blocks are taken: never a victim
        fresh = self._take(len(hashes) + 1)  # none has a hash: free, or evicted just now
        last = fresh.pop()  # the block of the token after the prompt: freed again
        setdefault = self._cached.setdefault
        B = self.block_size
        duplicates = 0
        for b, h in zip(fresh, hashes, strict=True):
            if setdefault(h, b) is b:
                current[b] = h
                tokens[b] = B
            else:  # another block holds this content: this one is freed
                tokens[b] = 0
                duplicates += 1
        tokens[last] = 0
        free = self._free
        free.append(last)
        kept = fresh
        if duplicates:
            free += [b for b in reversed(fresh) if current[b] is None]
            kept = [b for b in fresh if current[b] is not None]
        if self.events is not None:
            self.events.stored += map(current.__getitem__, kept) if duplicates else hashes
        kept.reverse()
        kept += reversed(idle)
        self._evictable.insert_new(kept)

    def unregister(self, block_ids: Sequence[int]) -> int:
        """Take blocks out of the prefix cache: their KV is not what their hash names (a rewind,
        core/rewind.py). One in use stays in use; a cached one (ref_count 0) becomes free. No
        eviction event is recorded: a write-back store saves evicted blocks, and these hold bad
        KV. Returns how many had a hash."""
        ref, hashes, tokens = self.ref_counts, self.block_hashes, self.block_tokens
        dropped = [b for b in dict.fromkeys(block_ids) if hashes[b] is not None]
        idle = [b for b in dropped if ref[b] == 0]
        self._evictable.remove_many(idle)
        for b in dropped:
            del self._cached[hashes[b]]
            hashes[b] = None
            self.block_salts.pop(b, None)
        for b in idle:
            tokens[b] = 0
        self._free.extend(idle)
        return len(dropped)

    def touch(self, block_id: int) -> None:
        """A cached-evictable block was looked up again (LRU refresh, LFU count)."""
        if block_id in self._evictable:
            self._evictable.touch(block_id)

    def evict_all_cached(self) -> int:
        """Drop every cached block not in use (reset the prefix cache); return how many."""
        victims = self._evict(len(self._evictable))
        for b in victims:
            self.block_tokens[b] = 0
        self._free.extend(victims)
        return len(victims)

    def evict_cached_where(self, owned: Callable[[str | None], bool]) -> int:
        """Drop the cached blocks not in use whose salt `owned` accepts (one tenant's prefix-cache
        reset: it must not touch, or count, any other tenant's blocks); return how many."""
        ref, hashes, salts = self.ref_counts, self.block_hashes, self.block_salts
        victims = [b for b in range(self.num_blocks) if ref[b] == 0 and hashes[b] is not None and owned(salts.get(b))]
        self._evictable.remove_many(victims)
        evicted = [hashes[b] for b in victims]
        for b, h in zip(victims, evicted, strict=True):
            del self._cached[h]
            hashes[b] = None
            salts.pop(b, None)
            self.block_tokens[b] = 0
        self._free.extend(victims)
        if self.events is not None:
            self.events.evicted.extend(evicted)
            self.events.evicted_block_ids.extend(victims)
        return len(victims)

    @property
    def has_events(self) -> bool:
        """Whether a drain would return any event (lets a driver skip empty drains)."""
        ev, ret = self.events, self.retention
        return ev is not None and bool(ev.stored or ev.evicted or (ret is not None and ret.changed))

    def drain_events(self) -> KVEvents:
        """The events since the last drain, with the retention they carry (core/retention.py)."""
        events, self.events = self.events, KVEvents()
        if events is None:
            return KVEvents()
        if self.retention is not None:
            events.retention = self.retention.published(events.stored, self._cached.get)
        return events

    def _evict(self, n: int, victims: list[int] | None = None) -> list[int]:
        """Take `n` cached blocks out of the cache, in eviction order (or `victims`, already
        taken out of the order by retention)."""
        if victims is None:
            victims = self._evictable.pop_victims(n)
        current, cached = self.block_hashes, self._cached
        hashes = list(map(current.__getitem__, victims))
        for b, h in zip(victims, hashes, strict=True):  # one pass while their entries are in cache
            current[b] = None
            del cached[h]
        if self.block_salts:  # only a tenant's blocks have one
            for b in victims:
                self.block_salts.pop(b, None)
        if self.events is not None:
            self.events.evicted.extend(hashes)
            self.events.evicted_block_ids.extend(victims)
        return victims
