"""CUDA paged attention: one Triton program per (query token, head), online softmax over the
token's own context blocks. `make_kernel()` jit-wraps it afresh, so a test that sets
TRITON_INTERPRET=1 first gets triton's interpreter and can run it on CPU tensors. (The kernel is
a module-level function: the interpreter patches the `tl` it finds in the kernel's globals.)
Imported only where a CUDA tensor needs attention.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

logger = logging.getLogger(__name__)


def make_kernel() -> Any:
    """The jitted kernel, or None when triton is missing."""
    return None if triton is None else triton.jit(_kernel)


def _kernel(
    Q,
    K,
    V,
    Out,
    BT,
    SEQ,
    POS,
    scale,
    window,
    softcap,
    sq_t,
    sq_h,
    sk_b,
    sk_s,
    sk_h,
    so_t,
    so_h,
    sbt,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    seq = tl.load(SEQ + t)
    pos = tl.load(POS + t)
    n_ctx = pos + 1
    lo = 0
    if HAS_WINDOW:  # keys k with pos - window < k <= pos
        lo = tl.maximum(pos - window + 1, 0)
    d = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK)
    q = tl.load(Q + t * sq_t + h * sq_h + d).to(tl.float32)
    m = -float("inf")
    denom = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for b in range(lo // BLOCK, (n_ctx + BLOCK - 1) // BLOCK):
        blk = tl.load(BT + seq * sbt + b)
        k_pos = b * BLOCK + offs
        valid = (k_pos < n_ctx) & (k_pos >= lo)
        base = blk * sk_b + offs[:, None] * sk_s + kvh * sk_h + d[None, :]
        k = tl.load(K + base, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(V + base, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1) * scale
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    tl.store(Out + t * so_t + h * so_h + d, (acc / denom).to(Out.dtype.element_ty))



@cache
def compiled_kernel() -> Any:
    kernel = make_kernel()
    if kernel is None:
        logger.info("triton not importable; CUDA paged attention uses the torch path")
    return kernel


def triton_usable(k_cache: Tensor, block_size: int) -> bool:
    d = k_cache.shape[-1]
    pow2 = (block_size & (block_size - 1)) == 0 and (d & (d - 1)) == 0
    return k_cache.is_cuda and pow2 and block_size >= 16 and compiled_kernel() is not None


def triton_paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    kernel: Any = None,
) -> Tensor:
    """[T, H, D]; `kernel` overrides the cached compiled one (the interpreter test)."""
    kernel = kernel or compiled_kernel()
    t, h, d = query.shape
    query = query.contiguous()
    out = torch.empty_like(query)
    kernel[(t, h)](
        query,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.token_seq,
        meta.positions,
        scale,
        window or 0,
        softcap or 1.0,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        GROUP=h // k_cache.shape[2],
        BLOCK=meta.block_size,
        HEAD_DIM=d,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    return out
