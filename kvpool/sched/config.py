"""The scheduler's configuration: one dataclass, validated in one place, read by every part."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import ConfigError

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "cache-aware", "shortest-prefill")


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    watermark: float = 0.01
    namespace: str = ""
    record_kv_events: bool = False
    kv_group_windows: tuple[int | None, ...] = (None,)  # per layer group (kvpool/core/layer_groups.py)
    scheduling_policy: str = "fcfs"  # fcfs | cache-aware | shortest-prefill (kvpool/sched/waiting_order.py)
    max_bypass: int = 8  # cache-aware: admissions a waiting request may be passed over by

    @property
    def prefill_chunk_tokens(self) -> int | None:
        """New tokens one forward computes of a prompt at most (None: the whole prompt at once)."""
        return self.max_num_batched_tokens if self.enable_chunked_prefill else None

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.max_bypass < 0:
            raise ConfigError(f"max_bypass must be >= 0, got {self.max_bypass}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
