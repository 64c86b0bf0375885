"""This machine's limits, measured in the same run as a benchmark, and a workload's floor time.

The floor is what no engine on this machine can beat: prefill at the best matmul rate over
fp32 and bf16, and each decode step at the slower of its matmuls at that rate and one read of
the weights (bf16, two bytes a parameter) at the measured DRAM read bandwidth. Attention FLOPs
and KV reads are left out, so the floor is optimistic (a lower bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class MachineLimits:
    matmul_gflops: dict[str, float]  # dtype name -> best rate measured now
    dram_read_gbps: float

    @property
    def best_dtype(self) -> str:
        return max(self.matmul_gflops, key=self.matmul_gflops.__getitem__)

    @property
    def best_gflops(self) -> float:
        return self.matmul_gflops[self.best_dtype]


def measure_matmul_gflops(dtype: torch.dtype = torch.float32, n: int = 2048, seconds: float = 1.0) -> float:
    """Best rate of square matmuls in `dtype` over a burst of about `seconds` (bf16 runs on AMX via oneDNN).

    The size doubles from 256 up to `n` while the next size's first product is predicted to take
    under a quarter of the burst: a CPU without bf16 hardware runs it at ~1 GFLOP/s, where one
    2048-cubed product alone would take a minute.
    """
    size = 256
    while True:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        t = time.perf_counter()
        a @ b
        rate = 2 * size**3 / (time.perf_counter() - t)
        if size >= n or 2 * (2 * size) ** 3 / rate > seconds / 4:
            break
        size *= 2
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - t) / 1e9)
    return best


def measure_dram_read_gbps(mib: int = 512, seconds: float = 1.0) -> float:
    """Best rate of summing a buffer far larger than the caches: DRAM read bandwidth, all threads."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def measure_limits() -> MachineLimits:
    rates = {"float32": measure_matmul_gflops(torch.float32), "bfloat16": measure_matmul_gflops(torch.bfloat16)}
    return MachineLimits(rates, measure_dram_read_gbps())


def floor_seconds(
    limits: MachineLimits, flops_per_token: float, params: int, prompt_lens: list[int], output_len: int
) -> float:
    """Lower bound for prefilling `prompt_lens` together, then `output_len` decode steps of all rows."""
    rate = limits.best_gflops * 1e9
    prefill = flops_per_token * sum(prompt_lens) / rate
    step = max(flops_per_token * len(prompt_lens) / rate, 2 * params / (limits.dram_read_gbps * 1e9))
    return prefill + (output_len - 1) * step


def describe(limits: MachineLimits, in_use: str) -> str:
    rates = ", ".join(f"{k} {v:.0f}" for k, v in limits.matmul_gflops.items())
    return (
        f"matmul GFLOP/s measured now: {rates} (best {limits.best_dtype}; in use {in_use} "
        f"{limits.matmul_gflops.get(in_use, float('nan')):.0f}); DRAM read {limits.dram_read_gbps:.1f} GB/s; "
        f"{torch.get_num_threads()} threads"
    )
