"""What the decoder computes, as data: shapes, numerics and the per-architecture features.

Every field here is something the model code implements; the loaders (HF config.json, GGUF
metadata) fill it and refuse any checkpoint setting that has no field.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor

from kvpool.errors import ConfigError

ROPE_SCALINGS = ("default", "llama3", "linear")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder; the defaults are Llama's."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Llama 3.1-style rope frequency scaling ("default" | "llama3" | "linear").
    rope_scaling_type: str = "default"
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # --- features beyond Llama (fields added here stay out of the fingerprint at default) ---
    architecture: str = "llama"  # the checkpoint's model_type: names it, changes nothing itself
    hidden_act: str = "silu"  # MLP gate activation
    o_bias: bool = False  # o_proj has a bias
    mlp_bias: bool = False  # gate/up/down projections have biases
    qk_norm: bool = False  # Qwen3 / Gemma-3: RMSNorm over each query and key head before rope
    norm_offset: bool = False  # Gemma: RMSNorm scales by (1 + w), computed in float32
    sandwich_norms: bool = False  # Gemma-2/3: also norm the attention and MLP outputs
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma-2)
    final_softcap: float | None = None  # tanh soft-capping of the logits (Gemma-2)
    rotary_dim: int | None = None  # partial rotary: only the first dims rotate (None: head_dim)
    layer_windows: tuple[int | None, ...] = ()  # per-layer sliding window in tokens; () = all full
    local_rope_theta: float | None = None  # Gemma-3: windowed layers use this base, no scaling

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_scaling_type not in ROPE_SCALINGS:
            raise ConfigError(
                f"rope scaling {self.rope_scaling_type!r} unsupported; use default, llama3 or linear"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} unsupported; use one of {ACTIVATIONS}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ConfigError(
                f"{len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ConfigError(f"sliding windows must be >= 1 token, got {self.layer_windows}")
        rd = self.rotary_dim
        if rd is not None and not (0 < rd <= self.head_dim and rd % 2 == 0):
            raise ConfigError(f"rotary_dim={rd} must be even and in 1..head_dim={self.head_dim}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `asdict` after a JSON round trip (lists back to tuples)."""
        tuples = {"eos_token_ids", "layer_windows"}
        return cls(**{k: tuple(v) if k in tuples else v for k, v in d.items()})

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (a query sees itself and the window-1 tokens before
        it), None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    def num_parameters(self) -> int:
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        attn += h if self.o_bias else 0
        attn += 2 * d if self.qk_norm else 0
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        norms = (4 if self.sandwich_norms else 2) * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * (attn + mlp + norms) + h

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V one token occupies across all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def fingerprint(self) -> str:
        """Short stable hash of the config, used to namespace the prefix cache. Feature fields
        at their defaults are left out, so a Llama's hash is the one it had before they existed."""
        defaults = {f.name: f.default for f in fields(self)}
        items = {k: v for k, v in asdict(self).items() if k in _LLAMA_FIELDS or v != defaults[k]}
        return hashlib.sha256(repr(sorted(items.items())).encode()).hexdigest()[:10]


# The fields ModelConfig had before the feature fields; only these enter every fingerprint.
_LLAMA_FIELDS = frozenset(
    f.name for f in fields(ModelConfig)[: [f.name for f in fields(ModelConfig)].index("architecture")]
)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> Tensor:
    """Inverse rotary frequencies over the rotated dims, with Llama 3 / linear scaling applied;
    `local`: Gemma-3's windowed layers (their own base, never scaled)."""
    d = config.rotary_dim or config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    if theta is None:
        raise ConfigError("this model has no local rope base")
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if local:
        return inv
    if config.rope_scaling_type == "linear":
        inv = inv / config.rope_scaling_factor
    elif config.rope_scaling_type == "llama3":
        low_wl = config.rope_original_max_position / config.rope_low_freq_factor
        high_wl = config.rope_original_max_position / config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / config.rope_scaling_factor, inv)
        smooth = (config.rope_original_max_position / wavelen - config.rope_low_freq_factor) / (
            config.rope_high_freq_factor - config.rope_low_freq_factor
        )
        blended = (1 - smooth) * scaled / config.rope_scaling_factor + smooth * scaled
        mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(mid, blended, scaled)
    return inv
