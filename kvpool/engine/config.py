"""Engine configuration: one dataclass, validated here, turned into CLI flags by kvpool.cli."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import ConfigError


def available_host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("cannot read MemAvailable from /proc/meminfo")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # a .gguf file or an HF directory; None = the bundled SmolLM2
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_memory: str = "1GiB"  # bytes, or a fraction of free memory
    num_blocks: int | None = None  # overrides kv_cache_memory (tests, experiments)
    swap_space: str = "1GiB"  # host KV pool for swap preemption
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    eviction_policy: str = "lru"
    preemption_mode: str = "recompute"
    watermark: float = 0.01
    threads: int | None = None
    max_logprobs: int = 20
    cpu_weight_packing: bool = True  # oneDNN-packed projections on CPU (faster; same results to rounding)
    cpu_q4_kernels: bool = True  # decode batches read the checkpoint's 4-bit groups (needs packing)
    kv_host_memory: str = "0"  # tiered store: host DRAM tier budget (0 = off)
    kv_disk_path: str | None = None
    kv_disk_size: str = "10GiB"
    kv_remote: str | None = None  # redis://host:port or mooncake://host:port
    kv_write_policy: str = "write-through"
    publish_kv_events: bool = False  # keep stored/evicted hashes for drain_kv_events()

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_write_policy not in ("write-through", "write-back"):
            raise ConfigError(f"kv_write_policy must be write-through or write-back, got {self.kv_write_policy!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")


_HELP = {
    "model": "a .gguf file or an HF model directory (default: the bundled SmolLM2-135M-Instruct)",
    "kv_cache_memory": "KV cache budget: bytes (2GiB, 512MB) or a fraction of free memory (0.3)",
    "num_blocks": "number of KV blocks (overrides --kv-cache-memory)",
    "swap_space": "host KV pool for swap preemption (bytes)",
    "preemption_mode": "recompute | swap",
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
