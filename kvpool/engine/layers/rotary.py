"""Rotary position embeddings: cos/sin tables by position, applied as HF's rotate_half does."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvpool.engine.models.config import ModelConfig, rope_inv_freq


class Rotary(nn.Module):
    """Cos/sin tables indexed by position, HF's rotate_half convention (halves, not pairs)."""

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.set_inv_freq(rope_inv_freq(config, local))

    def set_inv_freq(self, inv_freq: Tensor) -> None:
        pos = torch.arange(self.config.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(pos, inv_freq.to(torch.float64))
        device = self.cos.device
        self.cos = angles.cos().to(torch.float32).to(device)
        self.sin = angles.sin().to(torch.float32).to(device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """[T, 1, R/2] cos and sin for the given positions (R: the rotated dims)."""
        return (
            self.cos.index_select(0, positions).to(dtype).unsqueeze(1),
            self.sin.index_select(0, positions).to(dtype).unsqueeze(1),
        )


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, D]; rotates the first/second halves of the first R dims as HF's
    rotate_half does; dims past R (partial rotary) pass through."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
