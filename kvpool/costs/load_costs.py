"""The load-or-recompute planner's costs from a step cost model, for a driver without a clock
(the simulator): a store tier's read cost from the model's transfer costs, a range's prefill from
its step time. The engine measures the same quantities online instead (kvpool/engine/kv_io.py)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.hashing import BlockHash
from kvpool.core.load_plan import LoadEstimates, ReadCost
from kvpool.costs.cost_model import StepBatch, TransferCosts
from kvpool.errors import ConfigError


def tier_read_cost(transfers: TransferCosts, tier: str) -> ReadCost:
    """One block's read from `tier` as the cost model prices it (`TransferCosts.movement_time`): a
    host block pays one PCIe copy each; disk and remote latencies are paid once per step, so a
    block pays only its bytes."""
    if tier == "host":
        return ReadCost(transfers.pcie_latency, transfers.pcie_bandwidth)
    if tier == "disk":
        return ReadCost(0.0, transfers.disk_bandwidth)
    if tier == "remote":
        return ReadCost(0.0, transfers.net_bandwidth)
    raise ConfigError(f"store tier must be host, disk or remote, got {tier!r}")


class ModelLoadCosts:
    """`LoadCosts` (kvpool/core/load_plan.py) of one store `tier` priced by `cost_model` (a
    `RooflineCostModel` or `MeasuredCostModel`: anything with `step_time` and `transfers`);
    `overlap`: the tier is read under the forward (layer-wise), as `LoadEstimates.overlap`, whose
    first computes at most `first_forward_tokens` (the scheduler's token budget)."""

    def __init__(self, cost_model, tier: str, overlap: bool = False, first_forward_tokens: int | None = None) -> None:
        transfers = getattr(cost_model, "transfers", None)
        if not isinstance(transfers, TransferCosts):
            raise ConfigError(f"planning loads from the {tier} tier needs a cost model with transfer costs; "
                              f"{type(cost_model).__name__} has none (plan without it: load_plan off)")
        self.cost_model = cost_model
        self.tier = tier
        self._estimates = LoadEstimates({tier: tier_read_cost(transfers, tier)}, int(transfers.block_bytes),
                                        self.prefill_s, overlap, first_forward_tokens)

    def prefill_s(self, cached_tokens: int, new_tokens: int) -> float:
        """One step computing `new_tokens` after `cached_tokens` (the model's prefill cost)."""
        if new_tokens <= 0:
            return 0.0
        return self.cost_model.step_time(StepBatch([new_tokens], [cached_tokens + new_tokens]))

    def tiers_of(self, hashes: Sequence[BlockHash]) -> list[str]:
        return [self.tier] * len(hashes)

    def estimates(self) -> LoadEstimates:
        return self._estimates
