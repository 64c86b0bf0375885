"""A KV store tier below a simulated instance's device cache (host DRAM, local disk or a remote
pool), holding blocks by hash in an LRU manager of its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.hashing import BlockHash
from kvpool.core.kv_groups import group_key
from kvpool.core.kv_manager import KVCacheManager
from kvpool.core.receive import receive
from kvpool.errors import ConfigError

STORE_TIERS = ("host", "disk", "remote")


@dataclass(slots=True)
class SimStore:
    """A KV store tier below the device cache (host DRAM, local disk or a remote pool): the
    blocks it holds, by hash, in an LRU manager of its own. The scheduler plans loads from it
    as it does from the engine's store (`external_kv` -> `KVLoad` -> `finish_kv_load`); a step
    pays for the blocks it loads at the tier's cost (`StepBatch.blocks_from_<tier>`)."""

    blocks: KVCacheManager
    tier: str = "host"

    def __post_init__(self) -> None:
        if self.tier not in STORE_TIERS:
            raise ConfigError(f"store tier must be one of {STORE_TIERS}, got {self.tier!r}")

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, the tier holds (the scheduler's ExternalLookup)."""
        return len(self.blocks.match_prefix(hashes, len(hashes) * self.blocks.block_size + 1).block_ids)

    def put(self, hashes: Sequence[BlockHash], num_layer_groups: int = 1) -> int:
        """Store blocks (a save or a pool write); returns how many were written. A layer-grouped
        model's store holds each group's copy of a block under its own key (`group_key`), as the
        engine's does: `num_layer_groups` of them per hash."""
        return receive(self.blocks, [group_key(h, g) for g in range(num_layer_groups) for h in hashes])
