"""Physical KV blocks: reference counts, the free list, and the prefix cache's hash map.

A block is in exactly one of three states:
  in use     ref_count > 0, referenced by that many block tables;
  cached     ref_count == 0 and registered under a hash: its KV is valid and reusable, and
             it sits in the eviction policy's order until memory is needed;
  free       ref_count == 0, no hash: in the free list.
Allocation takes free blocks first and evicts cached blocks in policy order only when
the free list is empty. Every operation is O(1) per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.core.hashing import BlockHash
from kvpool.core.policies import EvictionPolicy, make_policy
from kvpool.errors import ConfigError, KVStateError, OutOfBlocks

MAX_BLOCK_SIZE = 256


@dataclass(slots=True)
class Block:
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
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields block 0 first
        self._evictable: EvictionPolicy = make_policy(eviction_policy)
        self._cached: dict[BlockHash, int] = {}
        self._tokens_in_use = 0
        self.events = KVEvents() if record_events else None
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free plus cached-evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash, in use or not."""
        return len(self._cached)

    @property
    def tokens_in_use(self) -> int:
        """Slots of in-use blocks that hold (or are reserved for) a known token."""
        return self._tokens_in_use

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def cached_items(self) -> list[tuple[BlockHash, int]]:
        return list(self._cached.items())

    # -- mutations -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks at ref_count 1, evicting cached blocks in policy order if needed."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, only {self.num_free} of {self.num_blocks} are free")
        out = []
        for _ in range(n):
            if self._free:
                block = self.blocks[self._free.pop()]
            else:
                block = self.blocks[self._evictable.pop_victim()]
                self._uncache(block)
                self.num_evictions += 1
            block.ref_count = 1
            block.num_tokens = 0
            out.append(block.block_id)
        return out

    def incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            if block.block_hash is None:
                raise KVStateError(f"block {block_id} is free; allocate it instead of sharing it")
            self._evictable.remove(block_id)
            self._tokens_in_use += block.num_tokens
        block.ref_count += 1

    def decref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise KVStateError(f"block {block_id} is already free (double free)")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._tokens_in_use -= block.num_tokens
            if block.block_hash is not None:
                self._evictable.insert(block_id)
            else:
                block.num_tokens = 0
                self._free.append(block_id)

    def add_tokens(self, block_id: int, n: int) -> None:
        """Record `n` more slots of an in-use block as holding tokens."""
        block = self.blocks[block_id]
        block.num_tokens += n
        self._tokens_in_use += n

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a full in-use block findable by its hash; False when another block already
        holds that content (the duplicate then stays private and is freed normally)."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return block.block_hash == block_hash
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        if self.events is not None:
            self.events.stored.append(block_hash)
        return True

    def touch(self, block_id: int) -> None:
        """A cached-evictable block was looked up again (LRU refresh, LFU count)."""
        if block_id in self._evictable:
            self._evictable.touch(block_id)

    def evict_all_cached(self) -> int:
        """Drop every cached block not in use (reset the prefix cache); return how many."""
        n = 0
        while len(self._evictable):
            block = self.blocks[self._evictable.pop_victim()]
            self._uncache(block)
            block.num_tokens = 0
            self._free.append(block.block_id)
            n += 1
        return n

    def drain_events(self) -> KVEvents:
        events, self.events = self.events, KVEvents()
        return events if events is not None else KVEvents()

    def _uncache(self, block: Block) -> None:
        del self._cached[block.block_hash]
        if self.events is not None:
            self.events.evicted.append(block.block_hash)
            self.events.evicted_block_ids.append(block.block_id)
        block.block_hash = None
