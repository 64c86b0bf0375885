"""Cost predictors the conductor uses to estimate TTFT, TBT and KV transfer times.

The conductor never measures anything: it asks a predictor. `LinearPredictor` is built from
a few constants (tests, roofline simulations); `FittedPredictor` adapts a step-time model
fitted from a profile of real engine steps (`kvpool.costs.cost_model.fit_step_model`);
`CostModelPredictor` asks the simulator's own cost model (roofline or measured), so the
conductor predicts with exactly the costs the simulated cluster then pays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvpool.costs.cost_model import CostModel, StepBatch
from kvpool.errors import ConfigError


class StepTimePredictor(Protocol):
    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill `new_tokens` on top of `cached_tokens` already in the KV cache."""

    def decode_step_time(self, batch_size: int, total_context: int) -> float:
        """Seconds of one decode step of `batch_size` sequences with `total_context` tokens."""

    def transfer_time(self, num_blocks: int) -> float:
        """Seconds to copy `num_blocks` KV blocks from another instance or the pool."""


class StepModel(Protocol):
    """What `kvpool.costs.cost_model.FittedStepModel` offers: one engine step's time."""

    def predict(self, new_tokens: list[int], context_lens: list[int]) -> float: ...


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class TransferCost:
    """A block copy costs a fixed latency plus its bytes over the link's bandwidth."""

    bandwidth_bytes_per_s: float = 25e9
    latency_s: float = 1e-3
    block_bytes: int = 0

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0:
            raise ConfigError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        _check_non_negative(latency_s=self.latency_s, block_bytes=self.block_bytes)

    def time(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.latency_s + num_blocks * self.block_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True)
class LinearPredictor:
    """Prefill: overhead + per-token cost + attention cost per (new token x attended token).
    Decode step: overhead + per-sequence cost + per-context-token cost (KV reads)."""

    prefill_s_per_token: float = 1e-4
    prefill_attn_s_per_token_pair: float = 0.0
    prefill_overhead_s: float = 0.0
    decode_step_s: float = 0.02
    decode_s_per_seq: float = 1e-4
    decode_s_per_context_token: float = 0.0
    transfer: TransferCost = field(default_factory=TransferCost)

    def __post_init__(self) -> None:
        _check_non_negative(
            prefill_s_per_token=self.prefill_s_per_token,
            prefill_attn_s_per_token_pair=self.prefill_attn_s_per_token_pair,
            prefill_overhead_s=self.prefill_overhead_s,
            decode_step_s=self.decode_step_s,
            decode_s_per_seq=self.decode_s_per_seq,
            decode_s_per_context_token=self.decode_s_per_context_token,
        )

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        # Causal attention: token j of the new span attends to cached + j tokens.
        pairs = new_tokens * (cached_tokens + (new_tokens + 1) / 2)
        return (
            self.prefill_overhead_s
            + new_tokens * self.prefill_s_per_token
            + pairs * self.prefill_attn_s_per_token_pair
        )

    def decode_step_time(self, batch_size: int, total_context: int) -> float:
        if batch_size <= 0:
            return 0.0
        return (
            self.decode_step_s
            + batch_size * self.decode_s_per_seq
            + total_context * self.decode_s_per_context_token
        )

    def transfer_time(self, num_blocks: int) -> float:
        return self.transfer.time(num_blocks)


@dataclass(frozen=True, slots=True)
class FittedPredictor:
    """Adapts a fitted engine-step model. `context_lens[i]` passed to it is the length of
    sequence i after the step (cached + new tokens); a decode batch's context is spread
    evenly over its sequences because the conductor only tracks the total."""

    model: StepModel
    transfer: TransferCost = field(default_factory=TransferCost)

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        return self.model.predict([new_tokens], [cached_tokens + new_tokens])

    def decode_step_time(self, batch_size: int, total_context: int) -> float:
        if batch_size <= 0:
            return 0.0
        return self.model.predict([1] * batch_size, _spread(total_context, batch_size))

    def transfer_time(self, num_blocks: int) -> float:
        return self.transfer.time(num_blocks)


@dataclass(frozen=True, slots=True)
class CostModelPredictor:
    """Adapts a simulator `CostModel`: one prefill or one decode step is one engine step."""

    cost_model: CostModel

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        return self.cost_model.step_time(StepBatch([new_tokens], [cached_tokens + new_tokens]))

    def decode_step_time(self, batch_size: int, total_context: int) -> float:
        if batch_size <= 0:
            return 0.0
        return self.cost_model.step_time(StepBatch([1] * batch_size, _spread(total_context, batch_size)))

    def transfer_time(self, num_blocks: int) -> float:
        return self.cost_model.kv_transfer_time(num_blocks)


# Rough costs of the bundled SmolLM2-135M (float32) on a 2-core CPU, used without --profile:
# ~1.5 ms per prefilled token, ~40 ms per decode step, KV blocks read from a loopback pool.
CPU_PREDICTOR = LinearPredictor(
    prefill_s_per_token=1.5e-3, prefill_overhead_s=0.02, decode_step_s=0.04, decode_s_per_seq=2e-3,
    transfer=TransferCost(bandwidth_bytes_per_s=1e9, latency_s=2e-3, block_bytes=16 * 30 * 2 * 3 * 64 * 4),
)


def _spread(total_context: int, batch_size: int) -> list[int]:
    """`batch_size` context lengths (each >= 1) summing to about `total_context`."""
    base, extra = divmod(max(total_context, batch_size), batch_size)
    return [base + 1] * extra + [base] * (batch_size - extra)
