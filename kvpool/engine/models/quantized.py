"""4-bit weights for decode-sized batches: the bundled GGUF stores every projection as Q4_1
groups, and a decode step streams the weights once per token batch, so reading the 4-bit
groups instead of their float32 copy cuts the bytes per step about 6x.

The groups are recovered from the float weights and checked bit for bit: a matrix is served
from 4 bits only when `d * q + m` (float32 multiply, then add, as the checkpoint's float copy
was made) reproduces every weight exactly, so results change by summation order alone."""

from __future__ import annotations

import torch
from torch import Tensor, nn

GROUP = 32
MAX_ROWS = 16  # above this a batch is compute-bound: the dense packed GEMM is faster


def q4_groups(weight: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(nibbles [N, K/2] uint8, scale [N, K/32], mins [N, K/32]) when each run of 32 weights
    along K is exactly scale * q + min with q in 0..15 and scale a float16 value; else None.
    Byte j of a group holds q[j] in its low nibble and q[j + 16] in its high one (GGUF's order)."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % GROUP:
        return None
    groups = weight.detach().reshape(-1, GROUP)
    low = groups.amin(-1)
    span = groups.amax(-1) - low
    # A Q4_1 quantizer maps a group's max to 15; where it did not, the smallest gap between
    # distinct weights is a multiple of the scale.
    scale = (span / 15).half().float()
    q, exact = _levels(groups, low, scale)
    if not bool(exact.all()):
        odd = (~exact).nonzero().squeeze(1)
        steps = groups[odd].sort(-1).values.diff(dim=-1)
        smallest = torch.where(steps > 0, steps, torch.inf).amin(-1)
        levels = (span[odd] / smallest).round().clamp(min=1)
        scale[odd] = (span[odd] / levels).half().float()
        q[odd], exact[odd] = _levels(groups[odd], low[odd], scale[odd])
        if not bool(exact.all()):
            return None
    q = q.to(torch.uint8)
    nibbles = (q[:, :16] | (q[:, 16:] << 4)).reshape(n, k // 2).contiguous()
    return nibbles, scale.reshape(n, k // GROUP).contiguous(), low.reshape(n, k // GROUP).contiguous()


def _levels(groups: Tensor, low: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Each weight's level under (scale, low), and which groups it reproduces bit for bit."""
    q = torch.where(scale[:, None] > 0, (groups - low[:, None]) / scale[:, None], 0).round()
    exact = ((q * scale[:, None] + low[:, None]) == groups).all(-1) & (q >= 0).all(-1) & (q <= 15).all(-1)
    return q, exact


class Q4Linear(nn.Module):
    """A frozen Linear with two copies of its weight: 4-bit groups for batches of at most
    MAX_ROWS rows (weight-bandwidth bound), the dense module for larger ones."""

    def __init__(self, dense: nn.Module, groups: tuple[Tensor, Tensor, Tensor], bias: Tensor | None) -> None:
        super().__init__()
        self.dense = dense
        self.nibbles, self.scale, self.mins = groups
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] > MAX_ROWS:
            return self.dense(x)
        y = torch.ops.kvpool.q4_linear(x, self.nibbles, self.scale, self.mins)
        return y if self.bias is None else y + self.bias
