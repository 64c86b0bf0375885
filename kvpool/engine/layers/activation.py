"""The gated MLP's activation: act(gate) * up over one fused gate_up projection."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from kvpool.engine.layers import fused_ops

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedActivation(nn.Module):
    """act(gate) * up of [gate | up] rows; SiLU runs as one fused op where the rows allow."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[name]

    def forward(self, gate_up: Tensor) -> Tensor:
        if self.act is F.silu and fused_ops.usable(gate_up):
            return fused_ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
