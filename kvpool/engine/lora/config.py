"""The LoRA limits, torch-free so the CLI can check them before anything loads."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """vLLM's LoRA limits: how many adapters may be loaded at once and their largest rank."""

    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
