"""Step-time cost models: what one engine iteration costs, from its shape in numbers only.

The simulator advances its virtual clock by `CostModel.step_time(batch)`; the conductor's
TTFT/TBT predictor uses the same models. Two kinds: a roofline from presets (for hardware we
do not have) and a linear model fitted to steps measured on the real engine.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from kvpool.costs.presets import HardwareSpec, ModelSpec, TensorParallel, get_hardware, get_model
from kvpool.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepBatch:
    """One engine iteration: per scheduled sequence its new tokens and context length after
    the step (parallel lists), plus the block movements the step performs first."""

    new_tokens: list[int]
    context_lens: list[int]
    blocks_copied: int = 0  # copy-on-write copies on the device
    blocks_swapped_in: int = 0
    blocks_swapped_out: int = 0
    blocks_from_host: int = 0  # prefix-cache loads from the store tiers
    blocks_from_disk: int = 0
    blocks_from_remote: int = 0
    idle_s: float = 0.0  # how long the instance sat idle before this step (see WAKE_AFTER_S)

    def __post_init__(self) -> None:
        if len(self.new_tokens) != len(self.context_lens):
            raise ConfigError(
                f"new_tokens has {len(self.new_tokens)} entries, "
                f"context_lens {len(self.context_lens)}"
            )

    @property
    def num_seqs(self) -> int:
        return len(self.new_tokens)


class CostModel(Protocol):
    def step_time(self, batch: StepBatch) -> float:
        """Seconds the iteration takes, block movements included."""
        ...

    def kv_transfer_time(self, num_blocks: int) -> float:
        """Seconds to ship `num_blocks` KV blocks between instances (P/D disaggregation)."""
        ...


@dataclass(slots=True, frozen=True)
class TransferCosts:
    """Block movements: bytes over a link plus a fixed latency per copy (per-copy memcpy/RPC
    launches dominate for small blocks).

    A swap moves a block's K and V of every layer as separate copies (`copies_per_swap` =
    2 x layers, as a paged engine's swap kernel issues them), so its fixed cost is per copy, not
    per block: this is what makes swapping small blocks slower than recomputing them."""

    block_bytes: float  # bytes of one block on one GPU
    pcie_bandwidth: float
    pcie_latency: float  # one host<->device copy
    disk_bandwidth: float
    disk_latency: float
    net_bandwidth: float
    net_latency: float
    device_copy_seconds: float  # one on-device block copy
    copies_per_swap: int = 1  # host<->device copies per swapped block

    @classmethod
    def from_specs(cls, tpar: TensorParallel, block_size: int, mbu: float) -> TransferCosts:
        hw = tpar.hardware
        block = tpar.kv_bytes_per_token_per_gpu() * block_size
        return cls(
            block_bytes=block,
            pcie_bandwidth=hw.pcie_bandwidth,
            pcie_latency=hw.pcie_latency,
            disk_bandwidth=min(hw.disk_bandwidth, hw.pcie_bandwidth),
            disk_latency=hw.disk_latency,
            net_bandwidth=hw.net_bandwidth,
            net_latency=hw.net_latency,
            device_copy_seconds=2 * block / (mbu * hw.mem_bandwidth),
            copies_per_swap=2 * tpar.model.num_layers,
        )

    def swap_time(self, num_blocks: int) -> float:
        """Swapping `num_blocks` blocks one way: every layer's K and V of each block is a copy."""
        return num_blocks * (self.copies_per_swap * self.pcie_latency + self.block_bytes / self.pcie_bandwidth)

    def movement_time(self, b: StepBatch) -> float:
        t = b.blocks_copied * self.device_copy_seconds
        if b.blocks_swapped_in or b.blocks_swapped_out:
            t += self.swap_time(b.blocks_swapped_in + b.blocks_swapped_out)
        t += b.blocks_from_host * (self.block_bytes / self.pcie_bandwidth + self.pcie_latency)
        if b.blocks_from_disk:  # disk -> host -> device; the SSD is the bottleneck
            t += self.disk_latency + b.blocks_from_disk * self.block_bytes / self.disk_bandwidth
        if b.blocks_from_remote:
            t += self.transfer_time(b.blocks_from_remote)
        return t

    def transfer_time(self, num_blocks: int) -> float:
        """Network transfer of `num_blocks` blocks: one latency, then bandwidth-bound."""
        if num_blocks <= 0:
            return 0.0
        return self.net_latency + num_blocks * self.block_bytes / self.net_bandwidth


class RooflineCostModel:
    """time = max(FLOPs / (mfu * peak), bytes / (mbu * bandwidth)) + all-reduce + overhead.

    FLOPs count 2 * params per new token plus causal attention over the context; bytes
    count the weights once per step, the KV of every context token read, and the new KV
    written. All per GPU under tensor parallelism `tp`.
    """

    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        tp: int = 1,
        block_size: int = 16,
        mfu: float = 0.5,
        mbu: float = 0.7,
        overhead_s: float = 2e-3,
    ) -> None:
        if not (0 < mfu <= 1 and 0 < mbu <= 1):
            raise ConfigError(f"mfu={mfu} and mbu={mbu} must be in (0, 1]")
        self.model, self.hardware = model, hardware
        self.tp = TensorParallel(model, hardware, tp)
        self.mfu, self.mbu, self.overhead_s = mfu, mbu, overhead_s
        self.transfers = TransferCosts.from_specs(self.tp, block_size, mbu)
        # Constants of compute_time, hoisted out of the simulator's per-step path. Each is the
        # same floating-point expression the formula evaluates, so step times are bit-identical.
        self._flops_per_token = 2.0 * model.params
        self._attn_flops_per_pair = model.num_layers * 4.0 * model.num_heads * model.head_dim
        self._flops_per_s = mfu * hardware.peak_flops
        self._bytes_per_s = mbu * hardware.mem_bandwidth
        self._weight_bytes = self.tp.weight_bytes_per_gpu()
        self._kv_bytes_per_token = self.tp.kv_bytes_per_token_per_gpu()
        self._allreduce: dict[int, float] = {}  # seconds by batch tokens (memo)

    def compute_time(self, new_tokens: list[int], context_lens: list[int]) -> float:
        if not new_tokens:
            return 0.0
        tokens = sum(new_tokens)
        if tokens == len(new_tokens) == len(context_lens) and min(new_tokens) == 1:
            return self.plain_decode_time(context_lens)
        per_pair = self._attn_flops_per_pair  # ModelSpec.attention_flops, term by term
        attention = sum([per_pair * (n * c - n * (n - 1) // 2) for n, c in zip(new_tokens, context_lens, strict=True)])
        return self._time(tokens, attention, sum(context_lens))

    def plain_decode_time(self, context_lens: list[int]) -> float:
        """`step_time` of a step decoding one token for each sequence (context lengths after the
        step) and moving no blocks: the simulator's commonest step, costed without a StepBatch
        (the same operations, so the same result)."""
        return self.plain_decode_time_of(len(context_lens), sum(context_lens))

    def plain_decode_time_of(self, num_seqs: int, context_tokens: int) -> float:
        """`plain_decode_time` from the batch size and the contexts' sum: each sequence's attention
        flops are a whole number (below 2**53), so their float sum is exact and equals one product."""
        if not num_seqs:
            return 0.0
        return self._time(num_seqs, self._attn_flops_per_pair * context_tokens, context_tokens)

    def plain_decode_steps(self, num_seqs: int, context_tokens: int, start: float, until: float, most: int,
                           least: int = 0) -> tuple[list[float], list[float]]:
        """Durations and end times of up to `most` plain decode steps from `start`, step i over
        contexts summing to `context_tokens + i * num_seqs`, while a step starts before `until`
        (the first `least` regardless): `plain_decode_time_of` per step, in one loop (a simulated
        decode instance costs 1.5M steps over the conversation trace) calling `_time` directly."""
        durations: list[float] = []
        ends: list[float] = []
        if not num_seqs:
            return durations, ends
        per_pair, time_of = self._attn_flops_per_pair, self._time
        t = start
        ctx = context_tokens
        for i in range(most):
            if i >= least and t >= until:
                break
            duration = time_of(num_seqs, per_pair * ctx, ctx)
            t += duration
            durations.append(duration)
            ends.append(t)
            ctx += num_seqs
        return durations, ends

    def _time(self, tokens: int, attention_flops: float, context_tokens: int) -> float:
        flops = self._flops_per_token * tokens + attention_flops
        nbytes = self._weight_bytes + self._kv_bytes_per_token * (context_tokens + tokens)
        t = max(flops / self.tp.tp / self._flops_per_s, nbytes / self._bytes_per_s)
        allreduce = self._allreduce.get(tokens)
        if allreduce is None:
            allreduce = self._allreduce[tokens] = self.tp.allreduce_seconds(tokens)
        return t + allreduce + self.overhead_s

    def step_time(self, batch: StepBatch) -> float:
        return self.compute_time(batch.new_tokens, batch.context_lens) + self.transfers.movement_time(batch)

    def kv_transfer_time(self, num_blocks: int) -> float:
        return self.transfers.transfer_time(num_blocks)


FEATURES = ("intercept", "num_seqs", "prefill_tokens", "prefill_chunks", "prefill_pairs", "decode_kv",
            "dense_step", "q4_tokens", "small_matmul_tokens", "wake")
# A step that starts after the engine sat idle this long pays a wake-up cost: on this shared CPU
# the first step after a pause ran 15-40% slower in some runs (n=128 prefill: 198 ms back to
# back, 229 ms after 0.5 s idle; n=32: 73 -> ~100 ms) and not at all in others.
WAKE_AFTER_S = 0.05
# Matmuls over few rows run at a lower rate per row than big ones: the first this many tokens of
# a step on the dense weights cost extra (measured ~1.3 ms per token at 32-128 tokens against
# ~1.07 at 2048). Without the term a serving run's prefills came out 3-8% short.
SMALL_MATMUL_TOKENS = 256


def step_features(new_tokens: list[int], context_lens: list[int], dense_above: int = 0,
                  idle_s: float = 0.0) -> list[float]:
    """The regressors of a step, shaped like the engine's work: a fixed overhead (weights
    streamed once per step), per-sequence work (a decode row costs little more: it rides on
    the weights' stream), per prefill token (matmuls, compute-bound), one attention call per
    prefill chunk, the chunks' causal (query, key) pairs, decode attention, which reads
    every decoding row's KV padded to the longest decode context. An engine with 4-bit
    kernels (`dense_above` > 0) serves steps of at most that many tokens from a sixth of the
    weight bytes, at a compute cost per token the dense kernels do not have: whether the
    step streams the dense weights, and the tokens of a 4-bit step. Then the tokens of a dense
    step up to SMALL_MATMUL_TOKENS, and whether the engine was idle for at least WAKE_AFTER_S
    before the step."""
    chunks = prefill = pairs = decodes = longest = 0
    for n, c in zip(new_tokens, context_lens, strict=True):
        if n == 1:
            decodes += 1
            longest = max(longest, c)
        else:
            chunks += 1
            prefill += n
            pairs += n * c - n * (n - 1) // 2
    tokens = decodes + prefill
    dense = bool(dense_above) and tokens > dense_above
    q4_tokens = float(tokens) if dense_above and not dense else 0.0
    small = 0.0 if q4_tokens else float(min(tokens, SMALL_MATMUL_TOKENS))
    return [1.0, float(len(new_tokens)), float(prefill), float(chunks), float(pairs), float(decodes * longest),
            float(dense), q4_tokens, small, float(idle_s >= WAKE_AFTER_S)]


@dataclass(slots=True, frozen=True)
class FittedStepModel:
    """t = coef · step_features; coefficients are non-negative so more work never costs less."""

    coef: tuple[float, ...]
    rel_rmse: float = 0.0  # relative RMS error on the samples it was fitted to
    dense_above: int = 0  # the profiled engine's 4-bit kernel limit (0: none)

    def predict(self, new_tokens: list[int], context_lens: list[int], idle_s: float = 0.0) -> float:
        if not new_tokens:
            return 0.0
        x = step_features(new_tokens, context_lens, self.dense_above, idle_s)
        return float(sum(c * v for c, v in zip(self.coef, x, strict=True)))

    def to_dict(self) -> dict:
        return {"features": list(FEATURES), "coef": list(self.coef), "rel_rmse": self.rel_rmse,
                "dense_above": self.dense_above}


def fit_step_model(samples: list[dict], dense_above: int = 0) -> FittedStepModel:
    """Least squares over measured steps (profile schema in MeasuredCostModel) in relative
    terms, so short decode steps count as much as long prefills. The weights are 1/predicted
    seconds (refined twice from a first fit weighted by 1/measured): weighting by the noisy
    measurement itself favours the steps that happened to run fast, and on a shared machine,
    where noise only ever slows a step down, that fits the fast mode instead of the mean
    (5-10% optimistic). Features whose coefficient comes out negative are dropped and the
    rest refitted (a simple NNLS)."""
    if len(samples) < 2:
        raise ConfigError(f"need at least 2 profile samples to fit, got {len(samples)}")
    x = np.array([step_features(s["new_tokens"], s["context_lens"], dense_above, s.get("idle_s", 0.0))
                  for s in samples])
    y = np.array([float(s["seconds"]) for s in samples])
    if (y <= 0).any():
        raise ConfigError("profile samples must have seconds > 0")
    coef = _nnls(x, y, 1.0 / y)
    for _ in range(2):
        coef = _nnls(x, y, 1.0 / np.maximum(x @ coef, 0.01 * y))
    rel = float(np.sqrt(np.mean(((x @ coef - y) / y) ** 2)))
    logger.info("fitted step model coef=%s rel_rmse=%.3f on %d samples", coef, rel, len(samples))
    return FittedStepModel(tuple(float(c) for c in coef), rel, dense_above)


def _nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares, dropping the most negative coefficient until none is negative."""
    active = list(range(x.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(sol)))
    coef = np.zeros(x.shape[1])
    coef[active] = np.clip(sol, 0.0, None)
    return coef


@dataclass(slots=True)
class MeasuredCostModel:
    """Step times from a profile measured on the real engine; block movements from presets.

    Profile (JSON, written by `kvpool bench profile`)::

        {"model": "smollm2-135m", "hardware": "cpu", "block_size": 16,
         "samples": [{"num_seqs": 2, "new_tokens": [1, 1], "context_lens": [40, 81],
                      "seconds": 0.031, "idle_s": 0.0}, ...],
         "engine": {"q4_rows": 16, ...}}

    `model` and `hardware` name presets (used for KV bytes and link speeds); each sample is
    one measured step with the per-sequence new tokens and context lengths after the step;
    `engine.q4_rows` (optional) is the engine's 4-bit kernel limit, which the step model needs;
    `idle_s` (optional) the engine's idle time before the step.
    """

    fitted: FittedStepModel
    transfers: TransferCosts
    source: dict = field(default_factory=dict)

    @classmethod
    def from_samples(
        cls, samples: list[dict], model: ModelSpec, hardware: HardwareSpec, block_size: int, tp: int = 1,
        dense_above: int = 0,
    ) -> MeasuredCostModel:
        tpar = TensorParallel(model, hardware, tp)
        return cls(fit_step_model(samples, dense_above), TransferCosts.from_specs(tpar, block_size, 0.7))

    @classmethod
    def from_document(cls, profile: dict) -> MeasuredCostModel:
        """From a parsed profile (`kvpool bench profile`'s JSON)."""
        missing = {"model", "hardware", "block_size", "samples"} - profile.keys()
        if missing:
            raise ConfigError(f"profile lacks keys {sorted(missing)}")
        return cls.from_samples(
            profile["samples"], get_model(profile["model"]), get_hardware(profile["hardware"]),
            int(profile["block_size"]), dense_above=int(profile.get("engine", {}).get("q4_rows", 0)),
        )

    @classmethod
    def from_profile(cls, path: str | Path) -> MeasuredCostModel:
        profile = json.loads(Path(path).read_text())
        try:
            out = cls.from_document(profile)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        out.source = {"path": str(path), "model": profile["model"], "hardware": profile["hardware"]}
        return out

    def step_time(self, batch: StepBatch) -> float:
        return (self.fitted.predict(batch.new_tokens, batch.context_lens, batch.idle_s)
                + self.transfers.movement_time(batch))

    def kv_transfer_time(self, num_blocks: int) -> float:
        return self.transfers.transfer_time(num_blocks)
