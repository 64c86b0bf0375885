"""bf16 steps through fused per-layer ops (`engine/kernels/fused_ops.cpp`).

A decode step at batch 8 runs ~600 torch ops, most of them elementwise work on a few thousand
values whose dispatch costs more than their arithmetic; a 2,048-token prefill step spends a
fifth of its time in the chains of elementwise ops (each a pass over the activations) that
RMSNorm, SiLU * up and RoPE are in torch. In bf16 every step, whatever its row count, runs
RMSNorm (+ the residual add), SiLU * up and RoPE + the K/V write as one op each, rounding
where torch's bf16 ops round. float32 steps take only RoPE + the K/V write (~12 ops a layer in
torch), which rounds as torch's float32 ops do, bit for bit: the norms and SiLU stay torch's,
the exact path the HF tests pin.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpool.engine.kernels import fused_ops_available


def usable(x: Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and fused_ops_available()


def rope_usable(x: Tensor) -> bool:
    return x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu" and fused_ops_available()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.ops.kvpool_fused.rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(norm(x + residual), x + residual)."""
    return torch.ops.kvpool_fused.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: Tensor) -> Tensor:
    return torch.ops.kvpool_fused.silu_mul(gate_up)


def rope_write_kv(
    qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, heads: int, kv_heads: int
) -> tuple[Tensor, Tensor]:
    """(q [T, H, D], k [T, Hkv, D]) rotated; k and V written to their slots."""
    return torch.ops.kvpool_fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
