"""The KV manager's records: what it keeps per sequence, a prefix hit, usage and hit statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.core.block_pool import BlockPool
from kvpool.core.hashing import BlockHash

CopyOp = tuple[int, int]  # (src block, dst block), device to device
SwapMap = list[tuple[int, int]]  # (src block, dst block) across device and host


@dataclass(slots=True)
class SeqBlocks:
    """What the KV manager keeps per sequence: one block table per layer group (the only table)."""

    tables: list[list[int]]
    num_tokens: int
    cache_salt: str | None
    hashes: list[BlockHash] = field(default_factory=list)
    num_registered: int = 0
    on_host: bool = False
    dead: list[int] = field(default_factory=list)  # per group: leading entries freed (NO_BLOCK)


@dataclass(slots=True, frozen=True)
class PrefixHit:
    """The cached blocks a new sequence starts from: one table per layer group, NO_BLOCK where a
    window group needs none; `idle_blocks` of them were at ref_count 0 (evictable) when matched."""

    tables: tuple[tuple[int, ...], ...]
    num_tokens: int
    idle_blocks: int = 0

    @property
    def block_ids(self) -> tuple[int, ...]:
        """Group 0's hit blocks."""
        return self.tables[0] if self.tables else ()


@dataclass(slots=True)
class PrefixCacheStats:
    queries_tokens: int = 0
    hits_tokens: int = 0
    queries_blocks: int = 0
    hits_blocks: int = 0

    def count(self, num_tokens: int, cached_tokens: int, block_size: int) -> None:
        """One allocation of `num_tokens` tokens whose first `cached_tokens` were cached."""
        self.queries_tokens += num_tokens
        self.hits_tokens += cached_tokens
        self.queries_blocks += num_tokens // block_size
        self.hits_blocks += cached_tokens // block_size

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

    @classmethod
    def of(cls, pool: BlockPool) -> KVUsage:
        free = pool.num_free
        return cls(total_blocks=pool.num_blocks, block_size=pool.block_size, used_blocks=pool.num_blocks - free,
                   free_blocks=free, cached_blocks=pool.num_cached_evictable, token_slots=pool.tokens_in_use)

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
