"""A PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`) read into the
decoder's fused layout, or refused by name.

kvpool's layers fuse q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an adapter's
per-module (A, B) pairs are stacked per fused projection: A's rows concatenated ([R, in]) and
B block-diagonal ([out, R]), each module's block in its own output columns. One matmul pair
per projection then gives every module's delta, zero in the columns no module targets.
Only plain LoRA is implemented; every PEFT feature that changes the computation otherwise
(DoRA, biases, extra trained modules, per-module ranks, ...) is refused by its name.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from kvpool.engine.models.config import ModelConfig
from kvpool.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF module name -> (kvpool projection, which block of its output columns); None: all of them
_MODULES = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "qkv_proj": ("qkv_proj", None), "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    "gate_up_proj": ("gate_up_proj", None), "down_proj": ("down_proj", None),
}
# adapter_config.json keys whose non-default value kvpool does not compute, with why
_REFUSED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "lora_bias": "LoRA biases (lora_bias)",
    "fan_in_fan_out": "transposed (Conv1D) weights (fan_in_fan_out)",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "target_parameters": "parameter targets (target_parameters)",
    "use_qalora": "QA-LoRA (use_qalora)",
}


@dataclass(frozen=True, slots=True)
class ProjectionDelta:
    """One projection's low-rank update: delta = (x @ a.T) @ b.T * scaling (float32)."""

    a: Tensor  # [R, in]
    b: Tensor  # [out, R]


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A loaded adapter: `key` is its stable identity (name + digests of both files), the one
    its KV blocks are hashed under; `layers[i]` maps a projection name to its delta."""

    name: str
    path: Path
    key: str
    rank: int
    scaling: float
    layers: tuple[dict[str, ProjectionDelta], ...]


def _columns(config: ModelConfig) -> dict[str, dict[str | None, tuple[int, int]]]:
    """Each fused projection's output columns per HF module (None: the whole projection)."""
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    h = config.hidden_size
    return {
        "qkv_proj": {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), None: (0, q + 2 * kv)},
        "o_proj": {None: (0, h)},
        "gate_up_proj": {"gate": (0, inter), "up": (inter, 2 * inter), None: (0, 2 * inter)},
        "down_proj": {None: (0, h)},
    }


def _in_features(config: ModelConfig) -> dict[str, int]:
    return {"qkv_proj": config.hidden_size, "o_proj": config.num_heads * config.head_dim,
            "gate_up_proj": config.hidden_size, "down_proj": config.intermediate_size}


def read_config(path: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a plain LoRA adapter_config.json; anything else refused by name."""
    file = path / CONFIG_FILE
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"LoRA adapter {path}: cannot read {CONFIG_FILE}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"LoRA adapter {path}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"LoRA adapter {path}: peft_type {cfg.get('peft_type')!r} is not supported (LORA only)")
    for key, what in _REFUSED.items():
        if cfg.get(key) not in (None, False, {}, [], ""):
            raise ConfigError(f"LoRA adapter {path}: {what} is not supported ({key}={cfg[key]!r})")
    if cfg.get("bias", "none") != "none":
        raise ConfigError(f"LoRA adapter {path}: trained biases are not supported (bias={cfg['bias']!r}; "
                          "only bias=\"none\")")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"LoRA adapter {path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ConfigError(f"LoRA adapter {path}: rank {rank} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ConfigError(f"LoRA adapter {path}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _tensor_site(name: str, path: Path, num_layers: int) -> tuple[int, str, str]:
    """(layer, HF module, "lora_A" | "lora_B") of a tensor name, or refused by name."""
    parts = name.split(".")
    try:
        at = parts.index("layers")
        layer, module, kind = int(parts[at + 1]), parts[at + 3], parts[at + 4]
    except (ValueError, IndexError):
        raise ConfigError(f"LoRA adapter {path}: tensor {name!r} targets a module outside the decoder layers "
                          f"(kvpool applies adapters to {', '.join(sorted(_MODULES))})") from None
    if module not in _MODULES or kind not in ("lora_A", "lora_B") or parts[-1] != "weight":
        raise ConfigError(f"LoRA adapter {path}: tensor {name!r} is not supported (kvpool applies lora_A / "
                          f"lora_B weights of {', '.join(sorted(_MODULES))})")
    if not 0 <= layer < num_layers:
        raise ConfigError(f"LoRA adapter {path}: tensor {name!r} targets layer {layer}; the model has {num_layers}")
    return layer, module, kind


def _read_pairs(path: Path, config: ModelConfig, rank: int, device: torch.device) -> dict:
    """{(layer, HF module): (A, B)} in float32, shapes checked against the model."""
    file = path / WEIGHTS_FILE
    if not file.is_file():
        extra = " (adapter_model.bin pickles are not read: save with safe_serialization)" if (
            path / "adapter_model.bin").exists() else ""
        raise ConfigError(f"LoRA adapter {path}: no {WEIGHTS_FILE}{extra}")
    found: dict[tuple[int, str], dict[str, Tensor]] = {}
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            layer, module, kind = _tensor_site(name, path, config.num_layers)
            found.setdefault((layer, module), {})[kind] = f.get_tensor(name).to(device, torch.float32)
    if not found:
        raise ConfigError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    cols, ins = _columns(config), _in_features(config)
    pairs = {}
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ConfigError(f"LoRA adapter {path}: layer {layer} {module} has only {', '.join(ab)}")
        proj, part = _MODULES[module]
        lo, hi = cols[proj][part]
        a, b = ab["lora_A"], ab["lora_B"]
        if tuple(a.shape) != (rank, ins[proj]) or tuple(b.shape) != (hi - lo, rank):
            raise ConfigError(f"LoRA adapter {path}: layer {layer} {module}: A {tuple(a.shape)} / B {tuple(b.shape)} "
                              f"do not fit the model (want A ({rank}, {ins[proj]}), B ({hi - lo}, {rank}))")
        pairs[(layer, module)] = (a, b)
    return pairs


def _fuse(pairs: dict, config: ModelConfig, rank: int, device: torch.device) -> tuple[dict[str, ProjectionDelta], ...]:
    """Per layer, one stacked (A, block-diagonal B) per projection that any module targets."""
    cols = _columns(config)
    layers: list[dict[str, ProjectionDelta]] = []
    for layer in range(config.num_layers):
        deltas = {}
        for proj, blocks in cols.items():
            mods = [(m, part) for m, (p, part) in _MODULES.items() if p == proj and (layer, m) in pairs]
            if not mods:
                continue
            if len({part for _, part in mods}) != len(mods) or (len(mods) > 1 and any(p is None for _, p in mods)):
                names = ", ".join(m for m, _ in mods)
                raise ConfigError(f"layer {layer}: modules {names} overlap in {proj}")
            a = torch.cat([pairs[(layer, m)][0] for m, _ in mods])
            b = torch.zeros(blocks[None][1], rank * len(mods), dtype=torch.float32, device=device)
            for i, (m, part) in enumerate(mods):
                lo, hi = blocks[part]
                b[lo:hi, i * rank : (i + 1) * rank] = pairs[(layer, m)][1]
            deltas[proj] = ProjectionDelta(a.contiguous(), b)
        layers.append(deltas)
    return tuple(layers)


def adapter_key(name: str, path: Path) -> str:
    """A stable identity: the same name and files give the same key in every process and
    restart (the disk tier's blocks stay valid); any change to either file gives a new one."""
    h = hashlib.blake2b(digest_size=16)
    h.update(name.encode() + b"\x00")
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(hashlib.sha256((path / file).read_bytes()).digest())
    return h.hexdigest()


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int,
                 device: torch.device) -> LoraAdapter:
    """Read and check a PEFT LoRA directory for `config`'s model."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"LoRA adapter {name!r}: {path} is not a directory (give a PEFT adapter directory)")
    rank, scaling = read_config(path, max_rank)
    pairs = _read_pairs(path, config, rank, device)
    return LoraAdapter(name, path, adapter_key(name, path), rank, scaling, _fuse(pairs, config, rank, device))
