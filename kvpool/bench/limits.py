"""This machine's limits, measured in the same run as a benchmark, and a workload's floor time.

The floor is what no engine on this machine can beat: prefill at the best matmul rate over
fp32 and bf16, and each decode step at the slower of its matmuls at that rate and one read of
the weights (bf16, two bytes a parameter) at the measured DRAM read bandwidth. Attention FLOPs
and KV reads are left out, so the floor is optimistic (a lower bound). Measured on the device
the benchmark runs on: a GPU's matmul rate and memory bandwidth, not its host's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class MachineLimits:
    matmul_gflops: dict[str, float]  # dtype name -> best rate measured now
    dram_read_gbps: float
    device: str = "cpu"

    @property
    def best_dtype(self) -> str:
        return max(self.matmul_gflops, key=self.matmul_gflops.__getitem__)

    @property
    def best_gflops(self) -> float:
        return self.matmul_gflops[self.best_dtype]


def _synced(device: torch.device) -> float:
    """perf_counter once the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def measure_matmul_gflops(dtype: torch.dtype = torch.float32, n: int = 2048, seconds: float = 1.0,
                          device: str | torch.device = "cpu") -> float:
    """Best rate of square matmuls in `dtype` over a burst of about `seconds` (bf16 runs on AMX via oneDNN).

    The size doubles from 256 up to `n` while the next size's first product is predicted to take
    under a quarter of the burst: a CPU without bf16 hardware runs it at ~1 GFLOP/s, where one
    2048-cubed product alone would take a minute.
    """
    device = torch.device(device)
    reps = 1
    if device.type == "cuda":  # straight to a large product: its first call (cuBLAS's pick) is a warm-up
        size, reps = 8192, 10
        a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
        a @ b
    else:
        size = 256
        while True:
            a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
            t = _synced(device)
            a @ b
            rate = 2 * size**3 / (_synced(device) - t)
            if size >= n or 2 * (2 * size) ** 3 / rate > seconds / 4:
                break
            size *= 2
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = _synced(device)
        for _ in range(reps):
            a @ b
        best = max(best, reps * 2 * size**3 / (_synced(device) - t) / 1e9)
    return best


def measure_dram_read_gbps(mib: int = 512, seconds: float = 1.0, device: str | torch.device = "cpu") -> float:
    """Best rate of summing a buffer far larger than the caches: DRAM (a GPU's HBM) read bandwidth."""
    device = torch.device(device)
    mib = max(mib, 4096) if device.type == "cuda" else mib  # far beyond a GPU's L2 too
    x = torch.ones(mib * 2**20 // 4, device=device)
    x.sum()
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = _synced(device)
        x.sum()
        best = max(best, x.numel() * 4 / (_synced(device) - t) / 1e9)
    return best


def measure_limits(device: str | torch.device = "cpu") -> MachineLimits:
    rates = {name: measure_matmul_gflops(dtype, device=device)
             for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    return MachineLimits(rates, measure_dram_read_gbps(device=device), str(torch.device(device)))


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
        f"{limits.matmul_gflops.get(in_use, float('nan')):.0f}); {_where(limits.device)} read "
        f"{limits.dram_read_gbps:.1f} GB/s; "
        + (torch.cuda.get_device_name(limits.device) if limits.device.startswith("cuda")
           else f"{torch.get_num_threads()} threads")
    )


def _where(device: str) -> str:
    return "memory" if device.startswith("cuda") else "DRAM"
