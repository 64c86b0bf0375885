"""Engine configuration: one dataclass, validated here, turned into CLI flags by kvpool.cli."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache

from kvpool.errors import ConfigError

logger = logging.getLogger(__name__)


def available_host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("cannot read MemAvailable from /proc/meminfo")


@cache
def cpu_bf16_flags() -> tuple[str, ...]:
    """The CPU features that make bf16 matmuls fast here (AMX tiles, AVX512-BF16 dot products)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return ()
    return tuple(x for x in ("amx_bf16", "avx512_bf16") if x in flags)


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto`: bfloat16 on a GPU that supports it (as vLLM runs bf16 checkpoints; on CUDA it is
    also the batch-invariant path, docs/determinism.md) and on a CPU with AMX or AVX512-BF16
    (several times fp32's matmul rate), float32 elsewhere; logged with the reason."""
    if dtype != "auto":
        return dtype
    if device == "cuda" or (device == "auto" and _cuda_available()):
        if _cuda_bf16():
            logger.info("dtype auto -> bfloat16 (CUDA device with bf16; --dtype float32 for fp32)")
            return "bfloat16"
        logger.info("dtype auto -> float32 (CUDA device without bf16)")
        return "float32"
    flags = cpu_bf16_flags()
    if flags:
        logger.info("dtype auto -> bfloat16 (CPU has %s; --dtype float32 for exact fp32)", ", ".join(flags))
        return "bfloat16"
    logger.info("dtype auto -> float32 (CPU lacks AMX and AVX512-BF16)")
    return "float32"


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8_e4m3", "int8")
QUANTIZATIONS = ("int8", "q4")  # weight-only, on load (kvpool/engine/models/quantize_on_load.py)
# --kv-cache-memory auto: room for this many full-length sequences (at least KV_AUTO_MIN), at
# most this fraction of the memory left free once the weights are in (vLLM's utilization fraction)
KV_AUTO_CONTEXTS = 2
KV_AUTO_FRACTION = 0.5
KV_AUTO_MIN = 1 << 30


def kv_budget(kv_cache_memory: str, bytes_per_token: int, max_model_len: int, available: int) -> int:
    """The KV cache's bytes: a size as given, a fraction of `available` (the memory free once
    the weights are loaded), or `auto`: KV_AUTO_CONTEXTS full-length sequences of this model
    (so the budget follows its per-token size), capped at KV_AUTO_FRACTION of `available`."""
    from kvpool.sizes import parse_bytes

    if kv_cache_memory != "auto":
        return parse_bytes(kv_cache_memory, "kv_cache_memory", available)
    wanted = max(KV_AUTO_MIN, KV_AUTO_CONTEXTS * max_model_len * bytes_per_token)
    cap = int(KV_AUTO_FRACTION * available)
    budget = min(wanted, cap)
    why = f"{KV_AUTO_CONTEXTS} sequences of {max_model_len} tokens" if wanted > KV_AUTO_MIN else "the floor"
    if budget < wanted:
        why = f"{KV_AUTO_FRACTION:g} of the free memory (below {why}: {wanted / 2**30:.2f} GiB)"
    logger.info("KV budget auto: %.2f GiB = %s; %d tokens of %d bytes, %.2f GiB free after the weights",
                budget / 2**30, why, budget // bytes_per_token, bytes_per_token, available / 2**30)
    return budget


def fixed_kv_bytes(kv_cache_memory: str) -> int:
    """The KV budget known before the model loads (a size): what the loader must leave free
    beside the weights. A fraction or `auto` sizes itself to what is left, so 0."""
    from kvpool.sizes import parse_bytes

    if kv_cache_memory == "auto":
        return 0
    return parse_bytes(kv_cache_memory, "kv_cache_memory", available=0)


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The KV dtype an engine runs (kv_quant.py): `auto` is the model's dtype (float16 included)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def _cuda_bf16() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # a .gguf file or an HF directory; None = the bundled SmolLM2
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16; auto is resolved in __post_init__
    kv_cache_dtype: str = "auto"  # auto (= dtype) | float32 | bfloat16 | fp8_e4m3 | int8 (kv_quant.py)
    block_size: int = 16
    kv_cache_memory: str = "auto"  # auto (kv_budget), bytes, or a fraction of free memory
    num_blocks: int | None = None  # overrides kv_cache_memory (tests, experiments)
    swap_space: str = "1GiB"  # host KV pool for swap preemption
    max_num_seqs: int = 256
    # A step's tokens: on CPU a 1,024-token chunk costs per token what a 2,048 one does, and a
    # prompt or decode arriving mid-step waits half as long (docs/performance.md, 2026-12-05).
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    eviction_policy: str = "lru"
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"  # fcfs | cache-aware | shortest-prefill (kvpool/sched/waiting_order.py)
    watermark: float = 0.01
    threads: int | None = None
    max_logprobs: int = 20
    cpu_weight_packing: bool = True  # oneDNN-packed projections on CPU (faster; same results to rounding)
    cpu_q4_kernels: bool = True  # decode batches read the checkpoint's 4-bit groups (needs packing)
    quantization: str | None = None  # int8 | q4: quantize an HF checkpoint's weights on load
    kv_host_memory: str = "0"  # tiered store: host DRAM tier budget (0 = off)
    kv_disk_path: str | None = None
    kv_disk_size: str = "10GiB"
    kv_remote: str | None = None  # redis://host:port or mooncake://host:port
    kv_write_policy: str = "write-through"
    kv_disk_codec: str = "none"  # none | zstd | zstd-shuffle | int8[+zstd] | int4[+zstd] (kvpool/store/codec.py)
    kv_remote_codec: str = "none"
    kv_layerwise_load: bool = True  # store hits land layer by layer during the forward (kvpool/engine/layerwise.py)
    kv_load_plan: bool = True  # load a store hit only as far as that beats recomputing it (core/load_plan.py)
    kv_layerwise_remote_reads: bool = False  # Redis / Mooncake hits read layer by layer too (docs/store.md)
    publish_kv_events: bool = False  # keep stored/evicted hashes for drain_kv_events()
    swa_freeing: bool = True  # windowed layers free KV blocks behind the window (kvpool/core/layer_groups.py)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_write_policy not in ("write-through", "write-back"):
            raise ConfigError(f"kv_write_policy must be write-through or write-back, got {self.kv_write_policy!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        self._check_values()
        self.dtype = resolve_dtype(self.dtype, self.device)  # after the checks: its log line is no error
        self.kv_cache_dtype = resolve_kv_dtype(self.kv_cache_dtype, self.dtype)

    def _check_values(self) -> None:
        """Every value a flag can give, checked before anything loads (a model, a port, torch)."""
        from kvpool.core.policies import POLICIES
        from kvpool.sched.config import SCHEDULING_POLICIES
        from kvpool.sizes import parse_bytes

        resolve_kv_dtype(self.kv_cache_dtype, "float32")  # the name; auto resolves after dtype

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                              f"got {self.scheduling_policy!r}")
        if self.eviction_policy.lower() not in POLICIES:
            raise ConfigError(f"eviction_policy must be one of {', '.join(POLICIES)}, got {self.eviction_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.kv_cache_memory != "auto":
            parse_bytes(self.kv_cache_memory, "kv_cache_memory", available=1)  # the syntax; the size comes later
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization is not None and self.model is not None and self.model.endswith(".gguf"):
            raise ConfigError(f"quantization={self.quantization!r}: model {self.model!r} is a GGUF file, quantized already")
        if self.quantization is not None and self.model is None:
            raise ConfigError(f"quantization={self.quantization!r}: the bundled model is a GGUF file, quantized already")
        for name in ("swap_space", "kv_host_memory", "kv_disk_size"):
            parse_bytes(getattr(self, name), name)
        if self.kv_remote and not self.kv_remote.startswith(("redis://", "mooncake://")):
            raise ConfigError(f"kv_remote must be redis://host:port or mooncake://host:port, got {self.kv_remote!r}")
        if self.model is not None:
            check_model_path(self.model)


def check_model_path(model: str) -> None:
    """A .gguf file, or an HF directory with its config.json: refused by name before loading."""
    from pathlib import Path

    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model directory {model!r} has no config.json (not an HF model directory)")
    elif not path.is_file():
        raise ConfigError(f"model {model!r} does not exist (give a .gguf file or an HF model directory)")
    elif path.suffix != ".gguf":
        raise ConfigError(f"model file {model!r} is not a .gguf file")


_HELP = {
    "dtype": "auto (bfloat16 on bf16 GPUs and on CPUs with AMX or AVX512-BF16, else float32) | float32 | bfloat16 | float16",
    "kv_cache_dtype": "KV cache dtype: auto (= --dtype) | float32 | bfloat16 | fp8_e4m3 | int8; int8 / fp8 "
    "keep one float32 scale per token and KV head (~1.9x the blocks of bf16 at head_dim 64; docs/kv_quant.md)",
    "model": "a .gguf file or an HF model directory (default: the bundled SmolLM2-135M-Instruct)",
    "kv_cache_memory": "KV cache budget: auto (2 full-length sequences of this model, at most half the memory "
    "free after the weights), bytes (2GiB, 512MB) or a fraction of the free memory (0.3)",
    "quantization": "int8 | q4: quantize an HF checkpoint's projections on load (weight-only, groups of 32: "
    "Q8_0 / Q4_1 for the 8-bit / 4-bit kernels; the LM head Q8_0); refused for a GGUF file",
    "num_blocks": "number of KV blocks of the whole model's layers (overrides --kv-cache-memory)",
    "swa_freeing": "sliding-window layers free KV blocks outside the window (off: they keep every block)",
    "swap_space": "host KV pool for swap preemption (bytes)",
    "preemption_mode": "recompute | swap",
    "scheduling_policy": "order of waiting requests: fcfs | cache-aware (most device-cached prompt tokens "
    "first) | shortest-prefill (fewest prompt tokens left to compute first); a request passed over 8 times "
    "goes next",
    "eviction_policy": "prefix-cache eviction: lru | lfu | fifo",
    "max_model_len": "context length (default: the model's)",
    "threads": "torch CPU threads (default: all cores)",
    "cpu_weight_packing": "oneDNN-packed projection weights on CPU",
    "cpu_q4_kernels": "batches of up to 16 tokens read projections from the checkpoint's 4-bit "
    "groups (Q4_1 GGUF) with a native kernel: same weights, bit for bit, ~6x fewer bytes",
    "kv_host_memory": "tiered KV store: host DRAM budget (e.g. 4GiB; 0 = off)",
    "kv_disk_path": "tiered KV store: a directory for the disk tier",
    "kv_disk_size": "tiered KV store: disk tier budget",
    "kv_remote": "tiered KV store: shared pool URL, redis://host:port or mooncake://host:port",
    "kv_write_policy": "write-through (save every computed block) | write-back (save on device eviction)",
    "kv_disk_codec": "disk tier block codec: none | zstd | zstd-shuffle (lossless), int8 | int8+zstd | int4 | "
    "int4+zstd (quantized: ~2x / ~3x fewer bytes of bf16 KV, approximate; see docs/store.md)",
    "kv_remote_codec": "remote tier block codec: as --kv-disk-codec",
    "kv_layerwise_load": "tiered KV store: write a store hit into the device cache layer by layer while "
    "the forward computes (the forward waits for layer l before computing it); off: whole blocks between steps",
    "kv_load_plan": "tiered KV store: load a store hit only as far as loading beats recomputing it, from each "
    "tier's measured read cost and the measured prefill cost (docs/store.md); off: always load the whole hit",
    "kv_layerwise_remote_reads": "tiered KV store: read Redis and Mooncake hits layer by layer under the forward "
    "too, as host and disk hits are (a round trip per block and layer: worth it where the forward is long next "
    "to them; off: read whole before the step, then written layer by layer)",
}


def add_engine_args(parser) -> None:
    """One flag per EngineConfig field, with the dataclass defaults."""
    import argparse
    from dataclasses import MISSING, fields

    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP.get(f.name))
            continue
        typ = {int: int, float: float}.get(type(default), str)
        if f.name in ("num_blocks", "max_model_len", "threads"):
            typ = int
        group.add_argument(flag, type=typ, default=default, help=_HELP.get(f.name))


def engine_config_from_args(args) -> EngineConfig:
    from dataclasses import fields

    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
