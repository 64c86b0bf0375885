"""The conductor's configuration and the records it exchanges with its drivers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.core.hashing import BlockHash
from kvpool.errors import ConfigError
from kvpool.sched.instance_load import InstanceLoad

__all__ = ["InstanceLoad"]  # the conductor's input; defined in the core, where instances compute it

POLICIES = ("random", "round-robin", "least-load", "cache-aware", "kv-centric")
REJECTIONS = ("none", "early", "predictive")


@dataclass(frozen=True, slots=True)
class ConductorConfig:
    """`ttft_slo_s`/`tbt_slo_s` None means no SLO. `replication_threshold` is the prefix
    length ratio (best elsewhere / own) from which kv-centric considers pulling blocks.
    `pull_from_peers`: kv-centric may pull from another instance, not only from the shared
    pool. The simulator can model such transfers; the real cluster moves KV only through the
    pool (which holds every instance's blocks, written through), so it must leave this off:
    without a pool a "pull" from a peer would be a full recompute."""

    policy: str = "kv-centric"
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    rejection: str = "none"
    replication_threshold: float = 2.0
    pull_from_peers: bool = False
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.rejection not in REJECTIONS:
            raise ConfigError(f"rejection must be one of {REJECTIONS}, got {self.rejection!r}")
        for name in ("ttft_slo_s", "tbt_slo_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be > 0 or None, got {value}")
        if self.replication_threshold < 1.0:
            raise ConfigError(
                f"replication_threshold must be >= 1.0, got {self.replication_threshold}"
            )
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """`block_hashes` are the chained hashes of the prompt's full blocks, in order."""

    request_id: str
    prompt_len: int
    block_hashes: Sequence[BlockHash] = field(default=())
    max_tokens: int = 1


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request goes, or why it does not. When `pull_from` is set the driver first
    copies blocks [cached_blocks - pull_blocks, cached_blocks) from that instance (or the
    pool) to `prefill_id`, then emits KV events for them, and prefill reuses `cached_blocks`."""

    accepted: bool
    prefill_id: str | None = None
    decode_id: str | None = None
    reason: str = ""
    predicted_ttft: float = 0.0
    cached_blocks: int = 0
    pull_from: str | None = None
    pull_blocks: int = 0
