"""The CPU backend: the native kernel (kernels/paged_attention.cpp; on AMX CPUs in bf16 both
products on tiles) runs decode rows and prefill chunks, each row reading only its own context
through its block table, its keys in tiles and parts at fixed positions (docs/determinism.md).
With KVPOOL_BATCH_INVARIANT=0 (for comparison only) chunks of SDPA_MIN tokens or more keep
SDPA's fused kernel."""

from __future__ import annotations

import torch
from torch import Tensor

from kvpool.engine.attention.metadata import AttentionMetadata
from kvpool.engine.attention.torch_path import _prefill_chunk
from kvpool.engine.kernels import paged_attention_available

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
_NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)  # uint8: fp8 e4m3 bits


def native_usable(query: Tensor, k_cache: Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in _NATIVE_DTYPES
        and k_cache.dtype in _NATIVE_KV_DTYPES
        and query.stride(-1) == 1
        and k_cache.is_contiguous()
        and paged_attention_available()
    )


def native_paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[Tensor, Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Every row at its own context's cost; chunks of SDPA_MIN tokens or more on SDPA."""
    if not paged_attention_available():
        raise RuntimeError("the native paged-attention kernel could not be built (see the log)")
    out = torch.empty(query.shape, dtype=query.dtype)
    if meta.native_seqs is not None and meta.native_seqs.numel():
        torch.ops.kvpool_attn.paged_attention_out(
            out,
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.native_seqs,
            scale,
            window or 0,
            softcap or 0.0,
        )
    for index in meta.sdpa_chunks:
        chunk = meta.prefills[index]
        out[chunk.start : chunk.end] = _prefill_chunk(query, k_cache, v_cache, meta, index, scale, new_kv, window, softcap)
    return out
