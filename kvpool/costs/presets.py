"""Model and hardware presets for the cost models: shapes and datasheet numbers, nothing measured.

A measured profile (MeasuredCostModel) replaces these for the machine at hand; the presets let
the simulator reason about GPUs this project cannot run on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpool.core.layer_groups import LayerGroups, group_layers
from kvpool.errors import ConfigError

GiB = 1024**3


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """A decoder's shape; enough for FLOPs, weight bytes and KV bytes per token."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    params: int
    dtype_bytes: int = 2
    layer_windows: tuple[int | None, ...] = ()  # per-layer sliding window; () = all full attention

    def layer_groups(self, swa_freeing: bool = True) -> LayerGroups:
        """The KV manager's layer groups (a pool block holds one group's layers)."""
        return group_layers(self.layer_windows, self.num_layers, swa_freeing)

    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def flops_per_token(self, context_len: int) -> float:
        """Forward FLOPs of one token attending to `context_len` tokens.

        2 * params for the matmuls, plus per layer QK^T and AV at 2 * heads * head_dim * context each.
        """
        return 2.0 * self.params + self.num_layers * 4.0 * self.num_heads * self.head_dim * context_len

    def attention_flops(self, num_new_tokens: int, context_len_after: int) -> float:
        """Context-dependent FLOPs of a chunk of new tokens ending at `context_len_after` (causal)."""
        n, c = num_new_tokens, context_len_after
        pairs = n * c - n * (n - 1) // 2  # sum of the context each new token sees
        return self.num_layers * 4.0 * self.num_heads * self.head_dim * pairs

    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes


@dataclass(slots=True, frozen=True)
class HardwareSpec:
    """One accelerator and its links. Bandwidths in bytes/s, latencies in s, flops dense fp16/bf16."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: int
    pcie_bandwidth: float
    pcie_latency: float
    net_bandwidth: float
    net_latency: float
    host_dram_bandwidth: float
    disk_bandwidth: float
    disk_latency: float
    nvlink_bandwidth: float = 0.0  # per-GPU intra-node bandwidth for tensor-parallel all-reduce


def _m(
    name: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
    inter: int, vocab: int, params: float, dtype: int = 2,
) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv_heads, head_dim, inter, vocab, int(params), dtype)


# Shapes from the models' published configs (HF config.json / papers).
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _m("opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, 12.85e9),
        _m("opt-66b", 64, 9216, 72, 72, 128, 36864, 50272, 65.7e9),
        _m("opt-175b", 96, 12288, 96, 96, 128, 49152, 50272, 175e9),
        _m("llama2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 6.74e9),
        _m("llama2-13b", 40, 5120, 40, 40, 128, 13824, 32000, 13.02e9),
        _m("llama2-70b", 80, 8192, 64, 8, 128, 28672, 32000, 68.98e9),
        _m("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8.03e9),
        # Tied embeddings; runs in fp32 on this project's CPU.
        _m("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 134_515_008, dtype=4),
        # Gemma-3 12B: 5 sliding-window (1024) layers to 1 global, 48 layers (global at 5, 11, ...)
        replace(_m("gemma3-12b", 48, 3840, 16, 8, 256, 15360, 262208, 12.19e9),
                layer_windows=tuple(None if i % 6 == 5 else 1024 for i in range(48))),
    )
}

_PCIE4 = 25e9  # PCIe Gen4 x16: 32 GB/s theoretical, ~25 GB/s achieved host<->device
_PCIE5 = 50e9  # PCIe Gen5 x16: 64 GB/s theoretical
_NVME = dict(disk_bandwidth=6e9, disk_latency=100e-6)  # one datacenter Gen4 NVMe SSD

# Datasheets: NVIDIA A100 (2021), H100 (2023) and H200 (2024) product briefs; dense (no
# sparsity) BF16 tensor-core peaks, SXM variants. A800 = A100 with NVLink capped at 400 GB/s.
# Network: one 200 Gb/s (A100/A800) or 400 Gb/s (H100/H200) RDMA NIC per GPU.
HARDWARE: dict[str, HardwareSpec] = {
    h.name: h
    for h in (
        HardwareSpec("a100-40gb", 312e12, 1555e9, 40 * GiB, _PCIE4, 10e-6, 25e9, 5e-6, 100e9,
                     nvlink_bandwidth=300e9, **_NVME),
        HardwareSpec("a100-80gb", 312e12, 2039e9, 80 * GiB, _PCIE4, 10e-6, 25e9, 5e-6, 100e9,
                     nvlink_bandwidth=300e9, **_NVME),
        HardwareSpec("a800-80gb", 312e12, 2039e9, 80 * GiB, _PCIE4, 10e-6, 25e9, 5e-6, 100e9,
                     nvlink_bandwidth=200e9, **_NVME),
        HardwareSpec("h100-80gb", 989e12, 3350e9, 80 * GiB, _PCIE5, 10e-6, 50e9, 5e-6, 200e9,
                     nvlink_bandwidth=450e9, **_NVME),
        HardwareSpec("h200-141gb", 989e12, 4800e9, 141 * 10**9, _PCIE5, 10e-6, 50e9, 5e-6, 200e9,
                     nvlink_bandwidth=450e9, **_NVME),
        # Placeholder for a 2-core CPU host; `kvpool bench profile` measures the real one.
        HardwareSpec("cpu", 1e11, 2e10, 24 * GiB, 1e10, 1e-6, 1e9, 50e-6, 2e10,
                     disk_bandwidth=1e9, disk_latency=200e-6),
    )
}


def _lookup(table: dict, kind: str, name: str):
    try:
        return table[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown {kind} {name!r}; choose one of {sorted(table)}") from None


def get_model(name: str) -> ModelSpec:
    return _lookup(MODELS, "model", name)


def get_hardware(name: str) -> HardwareSpec:
    return _lookup(HARDWARE, "hardware", name)


@dataclass(slots=True, frozen=True)
class TensorParallel:
    """A model sharded over `tp` GPUs of one node (Megatron-style: heads and FFN split)."""

    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.model.num_heads % self.tp:
            raise ConfigError(
                f"tp={self.tp} must be >= 1 and divide num_heads={self.model.num_heads}"
            )

    def weight_bytes_per_gpu(self) -> float:
        return self.model.weight_bytes() / self.tp

    def kv_bytes_per_token_per_gpu(self) -> float:
        """KV heads are split across GPUs; with fewer KV heads than GPUs they are replicated."""
        kv_heads = max(self.model.num_kv_heads / self.tp, 1.0)
        return 2 * self.model.num_layers * kv_heads * self.model.head_dim * self.model.dtype_bytes

    def kv_capacity_tokens(self, mem_fraction: float = 0.9) -> int:
        """Tokens of KV that fit per GPU after the weights, at `mem_fraction` of memory."""
        spare = self.hardware.mem_bytes * mem_fraction - self.weight_bytes_per_gpu()
        if spare <= 0:
            raise ConfigError(
                f"{self.model.name} weights ({self.weight_bytes_per_gpu() / GiB:.1f} GiB/GPU at "
                f"tp={self.tp}) exceed {mem_fraction:.0%} of {self.hardware.name} memory"
            )
        return int(spare // self.kv_bytes_per_token_per_gpu())

    def allreduce_seconds(self, num_tokens: int, latency_s: float = 5e-6) -> float:
        """Two ring all-reduces of the activations per layer: 2*(tp-1)/tp of the bytes each,
        plus a fixed launch/sync latency per all-reduce."""
        if self.tp == 1:
            return 0.0
        if self.hardware.nvlink_bandwidth <= 0:
            raise ConfigError(f"{self.hardware.name} has no nvlink_bandwidth for tp={self.tp}")
        per = num_tokens * self.model.hidden_size * self.model.dtype_bytes * 2 * (self.tp - 1) / self.tp
        return 2 * self.model.num_layers * (per / self.hardware.nvlink_bandwidth + latency_s)
