"""When is loading KV from a tier cheaper than recomputing it? Bytes vs FLOPs per prefix.

Reusing a cached prefix of N tokens means moving N * kv_bytes_per_token bytes from a tier
into device memory; not reusing it means a prefill of N tokens. GQA models (LLaMA2-70B: 8 KV
heads of 64) store ~8x fewer bytes per FLOP than MHA models (OPT-13B), so slower tiers pay
off for them. Every tier is read through PCIe into the device, so its path is capped there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpool.costs.presets import HardwareSpec, ModelSpec
from kvpool.errors import ConfigError

DEFAULT_CONTEXTS = (512, 2048, 8192, 32768)


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
