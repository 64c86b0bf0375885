"""Quantized KV blocks (`--kv-cache-dtype int8 | fp8_e4m3`): the layout, the write, the read.

A quantized cache keeps, for every token and KV head, its D quantized values followed by one
float32 scale (4 bytes), so a cache tensor is `[blocks, block_size, Hkv, D + 4]` of one byte
each: torch.int8 for int8 (symmetric, q = round(x / s), s = amax / 127) and torch.uint8 holding
float8_e4m3fn bit patterns for fp8 (q = x / s rounded to e4m3, s = amax / 448). The scale lives
with its token, so a block is self-contained bytes: swap, copy-on-write, prefix sharing and
every store tier move it unchanged, and a token written by a decode step never changes the
scale of tokens written before it. Per token-and-head rather than per block-and-head scales:
measured in docs/kv_quant.md (per-block scales would cost a rescale of the block on every
write that raises its max, and lost accuracy on int8).

Dequantized value = float32(q) * s, in float32, the same expression in the native kernel
(kernels/paged_attention.cpp) and here, so both read bit-identical K/V.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpool.errors import ConfigError

QUANTIZED = {"int8": torch.int8, "fp8_e4m3": torch.uint8}  # name -> storage dtype of the cache
SCALE_BYTES = 4  # one float32 scale per token and KV head, after its D values
_QMAX = {torch.int8: 127.0, torch.uint8: 448.0}
_FLOAT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def storage_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype of the cache tensors for a resolved KV dtype."""
    return QUANTIZED.get(kv_dtype) or _FLOAT[kv_dtype]


def row_width(kv_dtype: str, head_dim: int) -> int:
    """Elements per token and KV head in the cache: D, plus the scale's bytes when quantized."""
    return head_dim + SCALE_BYTES if kv_dtype in QUANTIZED else head_dim


def bytes_per_token(kv_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """K and V bytes of one token across all layers, scales counted."""
    elem = torch.empty((), dtype=storage_dtype(kv_dtype)).element_size()
    return 2 * num_layers * num_kv_heads * row_width(kv_dtype, head_dim) * elem


def is_quantized(cache: Tensor) -> bool:
    return cache.dtype in _QMAX


def quantize(x: Tensor, cache_dtype: torch.dtype) -> Tensor:
    """[..., D] float -> [..., D + 4] bytes of `cache_dtype` (values, then the float32 scale)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _QMAX[cache_dtype], torch.ones_like(amax))
    y = xf / scale
    if cache_dtype == torch.int8:
        q = y.round().clamp_(-127, 127).to(torch.int8)
    else:
        q = y.clamp_(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat((q, scale.view(cache_dtype)), dim=-1)


def dequantize(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """[..., D + 4] cache bytes -> [..., D] values in `dtype` (computed in float32)."""
    d = packed.shape[-1] - SCALE_BYTES
    scale = packed[..., d:].contiguous().view(torch.float32)
    q = packed[..., :d]
    qf = q.float() if packed.dtype == torch.int8 else q.view(torch.float8_e4m3fn).float()
    return (qf * scale).to(dtype)


def kv_values(cache_rows: Tensor, dtype: torch.dtype) -> Tensor:
    """Gathered cache rows as attention inputs of `dtype`: dequantized, or cast if stored in
    another float dtype than the model's."""
    if is_quantized(cache_rows):
        return dequantize(cache_rows, dtype)
    return cache_rows if cache_rows.dtype == dtype else cache_rows.to(dtype)


def allocate_caches(config, num_blocks: int, block_size: int, kv_dtype: str, device) -> list[tuple[Tensor, Tensor]]:
    """Per layer a zeroed (k, v) pair `[num_blocks, block_size, Hkv, row_width]` of the KV dtype's storage."""
    if num_blocks < 1 or block_size < 1:
        raise ConfigError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
    shape = (num_blocks, block_size, config.num_kv_heads, row_width(kv_dtype, config.head_dim))
    dtype = storage_dtype(kv_dtype)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)]
