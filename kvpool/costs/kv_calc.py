"""When is loading KV from a tier cheaper than recomputing it? Bytes vs FLOPs per prefix.

Reusing a cached prefix of N tokens means moving N * kv_bytes_per_token bytes from a tier
into device memory; not reusing it means a prefill of N tokens. GQA models (LLaMA2-70B: 8 KV
heads of 64) store ~8x fewer bytes per FLOP than MHA models (OPT-13B), so slower tiers pay
off for them. Every tier is read through PCIe into the device, so its path is capped there.

`break_even_table` asks the engine's own load-or-recompute planner (kvpool/core/load_plan.py)
the same question per tier: how many of a prefix's blocks it would load, and the slowest tier
bandwidth at which it would still load them all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpool.core.load_plan import LoadEstimates, ReadCost, break_even_bandwidth, plan_load
from kvpool.costs.presets import HardwareSpec, ModelSpec
from kvpool.errors import ConfigError

DEFAULT_CONTEXTS = (512, 2048, 8192, 32768)
TIERS = ("host", "disk", "remote")


@dataclass(slots=True, frozen=True)
class KVCalcRow:
    """Costs of one cached prefix of `context_len` tokens; times in seconds."""

    model: str
    hardware: str
    context_len: int
    kv_bytes: int
    recompute_flops: float
    recompute_s: float
    host_s: float
    disk_s: float
    remote_s: float

    @property
    def bytes_per_gflop(self) -> float:
        return self.kv_bytes / (self.recompute_flops / 1e9)

    def speedup(self, tier: str) -> float:
        """Recompute time over the read time from `tier` (host, disk or remote); >1 means load."""
        return self.recompute_s / getattr(self, f"{tier}_s")


def prefill_flops(model: ModelSpec, num_tokens: int) -> float:
    """FLOPs of a prefill of `num_tokens` tokens from an empty cache (causal attention)."""
    return 2.0 * model.params * num_tokens + model.attention_flops(num_tokens, num_tokens)


def kv_calc_table(
    model: ModelSpec,
    hardware: HardwareSpec,
    context_lens: Iterable[int] = DEFAULT_CONTEXTS,
    mfu: float = 0.5,
) -> list[KVCalcRow]:
    """One row per context length: KV bytes, recompute FLOPs and time, read time per tier.

    `mfu` is the fraction of peak FLOPs a prefill achieves (0.4-0.6 is typical for large batches).
    """
    if not 0 < mfu <= 1:
        raise ConfigError(f"mfu must be in (0, 1], got {mfu}")
    host_bw = min(hardware.host_dram_bandwidth, hardware.pcie_bandwidth)
    disk_bw = min(hardware.disk_bandwidth, hardware.pcie_bandwidth)
    net_bw = min(hardware.net_bandwidth, hardware.pcie_bandwidth)
    rows = []
    for n in context_lens:
        if n <= 0:
            raise ConfigError(f"context length must be positive, got {n}")
        kv = n * model.kv_bytes_per_token()
        flops = prefill_flops(model, n)
        rows.append(KVCalcRow(
            model=model.name, hardware=hardware.name, context_len=n, kv_bytes=kv,
            recompute_flops=flops, recompute_s=flops / (hardware.peak_flops * mfu),
            host_s=hardware.pcie_latency + kv / host_bw,
            disk_s=hardware.disk_latency + kv / disk_bw,
            remote_s=hardware.net_latency + kv / net_bw,
        ))
    return rows


def format_table(rows: Iterable[KVCalcRow]) -> str:
    """A plain-text table: sizes in MiB, times in ms, and the load-vs-recompute speedups."""
    lines = [f"{'model':<14}{'hw':<12}{'ctx':>7}{'KV MiB':>9}{'B/GFLOP':>9}{'recomp ms':>11}"
             f"{'host ms':>9}{'disk ms':>9}{'net ms':>9}{'x host':>8}{'x disk':>8}{'x net':>8}"]
    for r in rows:
        lines.append(
            f"{r.model:<14}{r.hardware:<12}{r.context_len:>7}{r.kv_bytes / 2**20:>9.1f}"
            f"{r.bytes_per_gflop:>9.0f}{r.recompute_s * 1e3:>11.2f}{r.host_s * 1e3:>9.2f}"
            f"{r.disk_s * 1e3:>9.2f}{r.remote_s * 1e3:>9.2f}{r.speedup('host'):>8.1f}"
            f"{r.speedup('disk'):>8.1f}{r.speedup('remote'):>8.1f}"
        )
    return "\n".join(lines)


@dataclass(slots=True, frozen=True)
class BreakEvenRow:
    """The planner's decision for a cached prefix of `context_len` tokens in one tier, followed by
    one new token: blocks it loads of `blocks`, and the bandwidth (bytes/s) below which it would
    stop loading them all (None: never, at any bandwidth, because the per-read latency alone loses)."""

    model: str
    hardware: str
    context_len: int
    tier: str
    blocks: int
    loaded_blocks: int
    bandwidth: float
    break_even_bandwidth: float | None


def tier_read_costs(hardware: HardwareSpec) -> dict[str, ReadCost]:
    """Each tier's read path as a per-read latency and a bandwidth, capped at PCIe."""
    return {
        "host": ReadCost(hardware.pcie_latency, min(hardware.host_dram_bandwidth, hardware.pcie_bandwidth)),
        "disk": ReadCost(hardware.disk_latency, min(hardware.disk_bandwidth, hardware.pcie_bandwidth)),
        "remote": ReadCost(hardware.net_latency, min(hardware.net_bandwidth, hardware.pcie_bandwidth)),
    }


def break_even_table(model: ModelSpec, hardware: HardwareSpec, context_lens: Iterable[int] = DEFAULT_CONTEXTS,
                     mfu: float = 0.5, block_size: int = 16) -> list[BreakEvenRow]:
    """Per context length and tier: the planner's load-or-recompute decision at the preset's
    bandwidth, and its break-even bandwidth. Prefill costs FLOPs / (mfu * peak); each block is one
    read of `block_size` tokens' KV."""
    if not 0 < mfu <= 1:
        raise ConfigError(f"mfu must be in (0, 1], got {mfu}")
    rate = hardware.peak_flops * mfu

    def prefill_s(cached: int, new: int) -> float:
        return (2.0 * model.params * new + model.attention_flops(new, cached + new)) / rate if new > 0 else 0.0

    read = tier_read_costs(hardware)
    est = LoadEstimates(read, block_size * model.kv_bytes_per_token(), prefill_s)
    rows = []
    for n in context_lens:
        if n < block_size:
            raise ConfigError(f"context length must be at least one block ({block_size} tokens), got {n}")
        blocks = n // block_size
        for tier in TIERS:
            plan = plan_load([tier] * blocks, est, 0, blocks * block_size + 1, block_size)
            rows.append(BreakEvenRow(model.name, hardware.name, blocks * block_size, tier, blocks, plan.blocks,
                                     read[tier].bandwidth,
                                     break_even_bandwidth(est, tier, 0, blocks * block_size + 1, block_size, blocks)))
    return rows


def format_break_even(rows: Iterable[BreakEvenRow]) -> str:
    """A plain-text table of the planner's decisions: GB/s, and blocks loaded of the prefix's."""
    lines = [f"{'model':<14}{'hw':<12}{'ctx':>7}{'tier':>8}{'GB/s':>9}{'loads':>13}{'break-even GB/s':>17}"]
    for r in rows:
        even = "never" if r.break_even_bandwidth is None else f"{r.break_even_bandwidth / 1e9:.3f}"
        lines.append(f"{r.model:<14}{r.hardware:<12}{r.context_len:>7}{r.tier:>8}{r.bandwidth / 1e9:>9.2f}"
                     f"{f'{r.loaded_blocks}/{r.blocks}':>13}{even:>17}")
    return "\n".join(lines)
