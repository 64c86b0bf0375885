"""RMSNorm, the one norm of the Llama family, which may also take the residual add before it."""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvpool.engine.layers import fused_ops


class RMSNorm(nn.Module):
    """Llama's RMSNorm (w * normed, cast first); with `offset`, Gemma's ((1 + w) * normed in
    float32, cast last). Given the residual stream, it normalizes x + residual and returns the
    sum too, so a layer carries the add into its next norm: on CPU rows one fused op, which
    rounds the sum to the rows' dtype before normalizing it, as the separate add does."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    @overload
    def forward(self, x: Tensor, residual: None = None) -> Tensor: ...
    @overload
    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]: ...

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if not self.offset and x.dim() == 2 and fused_ops.usable(x):
            if residual is None:
                return fused_ops.rms_norm(x, self.weight, self.eps)
            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: Tensor) -> Tensor:
        if self.offset:
            scale = 1.0 + self.weight.float()
            return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
