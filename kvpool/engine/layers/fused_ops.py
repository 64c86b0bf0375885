"""Fused per-layer ops (`engine/kernels/fused_ops.cpp`).

A decode step at batch 8 runs ~600 torch ops, most of them elementwise work on a few thousand
values whose dispatch costs more than their arithmetic; a 2,048-token prefill step spends a
fifth of its time in the chains of elementwise ops (each a pass over the activations) that
RMSNorm, SiLU * up and RoPE are in torch. bf16 steps run RMSNorm (+ the residual add), SiLU *
up and RoPE + the K/V write as one op each, rounding where torch's bf16 ops round. float32
steps take them too: RoPE + the K/V write round as torch's float32 ops do, bit for bit; the
norm differs in the summation order of its squares and SiLU in exp's last bits (a few ulps, as
the 4-bit kernels' sums already differ from a dense matmul).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpool.engine.kernels import fused_ops_available


def usable(x: Tensor) -> bool:
    """The fused ops take x's rows (float32 or bf16, on CPU, the kernel built)."""
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


def takes_logits(logits: Tensor) -> bool:
    """Whether the sampling ops take these logits (float32 or bfloat16 rows on CPU, the kernel
    built); bfloat16 rows are read as the float32 values they are, so either gives the same result."""
    return logits.dtype in (torch.float32, torch.bfloat16) and logits.device.type == "cpu" \
        and logits.dim() == 2 and logits.shape[1] > 0 and fused_ops_available()


def argmax_rows(logits: Tensor) -> Tensor:
    """torch.argmax(logits, -1): the first maximum's index, a NaN counting as the maximum."""
    return torch.ops.kvpool_fused.argmax_rows(logits.contiguous())


def log_softmax_at(logits: Tensor, ids: Tensor) -> Tensor:
    """log_softmax(logits, -1).gather(-1, ids) ([N, k] ids), without the [N, V] result: every
    token's value from the same two row terms, so a token reads the same alone or in a top-k."""
    top, log_sum = torch.ops.kvpool_fused.log_softmax_parts(logits.contiguous())
    return (logits.gather(-1, ids).float() - top.unsqueeze(1)) - log_sum.unsqueeze(1)
