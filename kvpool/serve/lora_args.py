"""`kvpool serve`'s LoRA flags, vLLM's names: `--enable-lora`, `--lora-modules name=path ...`
(or vLLM's JSON form), `--max-loras`, `--max-lora-rank`, and `--allow-runtime-lora-updating`
(default: vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) for the load/unload routes. Torch-free:
checked before the model loads."""

from __future__ import annotations

import argparse
import json
import os

from kvpool.engine.lora.config import LoraConfig
from kvpool.errors import ConfigError

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (PEFT directories) beside the base model, chosen per request by `model`")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="adapters to load at start: name=path, or vLLM's JSON {\"name\": ..., \"path\": ...}")
    group.add_argument("--max-loras", type=int, default=1, help="most adapters loaded at once (all stay resident)")
    group.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    group.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction,
                       default=os.environ.get(RUNTIME_ENV, "").lower() in ("1", "true"),
                       help=f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default: ${RUNTIME_ENV})")


def lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """(name, path) of each --lora-modules value, refused by name when malformed."""
    out = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--lora-modules {value!r}: not JSON ({e.msg})") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
                raise ConfigError(f"--lora-modules {value!r}: the JSON form needs string \"name\" and \"path\"")
            if spec.get("base_model_name") is not None:
                raise ConfigError(f"--lora-modules {value!r}: base_model_name is not supported (one base model)")
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ConfigError(f"--lora-modules {value!r}: give name=path (or the JSON form)")
        if not name or not path:
            raise ConfigError(f"--lora-modules {value!r}: the name and the path may not be empty")
        out.append((name, path))
    return out


def lora_setup(args: argparse.Namespace) -> tuple[LoraConfig, list[tuple[str, str]]] | None:
    """The LoRA settings of `kvpool serve`, checked before the model loads (None: LoRA off)."""
    modules = lora_modules(args.lora_modules)
    if not args.enable_lora:
        if modules or args.allow_runtime_lora_updating:
            raise ConfigError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        return None
    return LoraConfig(args.max_loras, args.max_lora_rank), modules
