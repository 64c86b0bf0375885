"""A KV store tier below a simulated instance's device cache (host DRAM, local disk or a remote
pool), holding blocks by hash in an LRU manager of its own, and what reading from it costs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.hashing import BlockHash
from kvpool.core.kv_groups import group_key
from kvpool.core.kv_manager import KVCacheManager
from kvpool.core.receive import receive
from kvpool.costs.cost_model import CostModel, StepBatch
from kvpool.costs.load_costs import ModelLoadCosts
from kvpool.errors import ConfigError
from kvpool.sched.scheduler import Scheduler

STORE_TIERS = ("host", "disk", "remote")
# the tiers the engine reads a range of, so layer by layer under the forward (`--kv-layerwise-load`:
# host, disk); a remote pool's values (Redis, Mooncake) are read whole before the step
RANGE_TIERS = ("host", "disk")


@dataclass(slots=True)
class SimStore:
    """A KV store tier below the device cache (host DRAM, local disk or a remote pool): the
    blocks it holds, by hash, in an LRU manager of its own. The scheduler plans loads from it
    as it does from the engine's store (`external_kv` -> `KVLoad` -> `finish_kv_load`); a step
    pays for the blocks it loads at the tier's cost (`StepBatch.blocks_from_<tier>`). How the
    instance reads it, as the engine's flags say: `plan` (`--kv-load-plan`: load a hit only as far
    as that beats recomputing it) and `layerwise` (`--kv-layerwise-load`: a RANGE_TIERS tier's
    blocks read under the forward)."""

    blocks: KVCacheManager
    tier: str = "host"
    plan: bool = True
    layerwise: bool = False

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

    def charge(self, batch: StepBatch, blocks: int) -> None:
        """Price reading `blocks` (the cost model's blocks) from this tier in `batch`."""
        name = f"blocks_from_{self.tier}"
        setattr(batch, name, getattr(batch, name) + blocks)

    def read_batch(self, blocks: int) -> StepBatch:
        """A step that only reads `blocks` from this tier (its cost is the reads')."""
        batch = StepBatch([], [])
        self.charge(batch, blocks)
        return batch


class StoreReads:
    """How a simulated instance reads its store, as the engine's connector does: the planner's
    costs handed to admission (`store.plan`); loads that land when the step planning them ends,
    which pays their reads (whole-block), or, layer-wise (`store.layerwise`, a RANGE_TIERS tier,
    one layer group), reads only their headers (not priced) and the next step reads them under
    its forward, paying the longer of its compute and the reads (the planner prices them so)."""

    def __init__(self, store: SimStore, sched: Scheduler, cost_model: CostModel) -> None:
        self.store = store
        self.cost_model = cost_model
        self.num_groups = sched.kv.num_groups
        self.layerwise = store.layerwise and store.tier in RANGE_TIERS and self.num_groups == 1
        self.staged = 0  # blocks landed at the last step's end: read under the next forward
        if store.plan:
            sched.admission.load_costs = ModelLoadCosts(cost_model, store.tier, overlap=self.layerwise,
                                                        first_forward_tokens=sched.config.prefill_chunk_tokens)

    def planned(self, batch: StepBatch, blocks: int) -> None:
        """`blocks` planned in the step `batch` (a layer-grouped model's block holds 1/G of the
        cost model's); whole-block, the step reads them."""
        if not self.layerwise:
            self.store.charge(batch, -(-blocks // self.num_groups))

    def landed(self, blocks: int) -> None:
        if self.layerwise:
            self.staged += blocks

    def step_time(self, batch: StepBatch) -> float:
        """The step's cost, with the staged blocks' reads under its forward (a step without a
        forward reads them whole)."""
        duration = self.cost_model.step_time(batch)
        staged, self.staged = self.staged, 0
        if staged:
            reads = self.cost_model.step_time(self.store.read_batch(staged))
            duration = max(duration, reads) if batch.new_tokens else duration + reads
        return duration
