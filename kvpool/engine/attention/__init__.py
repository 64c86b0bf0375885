"""Paged attention: K/V live in fixed-size blocks addressed through per-sequence block tables.

Every layer first writes the step's new K/V into their slots, then attends, so a sequence may
read a block another sequence of the same batch has just written (shared prefix blocks).
Backends, the first usable one runs (`BACKENDS`): on CUDA the Triton kernel
(kernels/triton_attention.py); on CPU the native kernel (native.py), a row's result the same
bits whether its keys were computed in this step, an earlier chunk or came from a cache hit
(docs/determinism.md); elsewhere, and without a C++ compiler, the torch path (torch_path.py).
All share one step's metadata (metadata.py), built once per step by the runner.

Sliding window W (HF transformers' `sliding_window`, Mistral / Gemma 2 / Gemma 3): a query at
position p sees key positions k with p - W < k <= p, i.e. W keys counting itself. Logit softcap
c (Gemma 2): scores s = scale * q.k become c * tanh(s / c) before the mask and the softmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from kvpool.engine.attention.metadata import SDPA_MIN, AttentionMetadata, KVCache, PrefillChunk
from kvpool.engine.attention.native import native_paged_attention, native_usable
from kvpool.engine.attention.torch_path import torch_paged_attention
from kvpool.engine.kv_quant import is_quantized, quantize
from kvpool.errors import InvalidRequest

__all__ = [
    "SDPA_MIN", "AttentionMetadata", "KVCache", "PrefillChunk", "BACKENDS", "native_paged_attention",
    "paged_attention", "torch_paged_attention", "write_kv",
]


class Attend(Protocol):
    def __call__(self, query: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                 new_kv: tuple[Tensor, Tensor] | None, window: int | None, softcap: float | None) -> Tensor: ...


@dataclass(frozen=True, slots=True)
class Backend:
    """One attention implementation: whether it serves these tensors, and the call."""

    name: str
    usable: Callable[[Tensor, Tensor, int], bool]  # (query, k_cache, block_size)
    attend: Attend


def _triton_usable(query: Tensor, k_cache: Tensor, block_size: int) -> bool:
    if not query.is_cuda or is_quantized(k_cache):
        return False
    from kvpool.engine.kernels import triton_attention  # imported only where CUDA tensors need it

    return triton_attention.triton_usable(k_cache, block_size)


def _triton_attend(query, k_cache, v_cache, meta, scale, new_kv, window, softcap) -> Tensor:
    from kvpool.engine.kernels import triton_attention

    return triton_attention.triton_paged_attention(query, k_cache, v_cache, meta, scale, window, softcap)


BACKENDS = (
    Backend("triton", _triton_usable, _triton_attend),
    Backend("native", lambda query, k_cache, block_size: native_usable(query, k_cache), native_paged_attention),
    Backend("torch", lambda query, k_cache, block_size: True, torch_paged_attention),
)


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Scatter [T, Hkv, D] key/value rows into their flat slots (quantized per token and head
    for an int8 / fp8 cache, see kv_quant.py)."""
    hkv, d = k_cache.shape[-2:]
    if is_quantized(k_cache):
        key, value = quantize(key, k_cache.dtype), quantize(value, v_cache.dtype)
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[Tensor, Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """[T, H, D] attention output from the first usable backend. `new_kv` (this step's K/V rows)
    lets fresh prompts skip the gather; results are the same without it. `window` / `softcap`:
    see the module docstring."""
    _check_window_softcap(window, softcap)
    if is_quantized(k_cache):
        new_kv = None  # attend to the stored (quantized) K/V, so a prefix hit reads what a miss did
    backend = next(b for b in BACKENDS if b.usable(query, k_cache, meta.block_size))
    return backend.attend(query, k_cache, v_cache, meta, scale, new_kv, window, softcap)


def _check_window_softcap(window: int | None, softcap: float | None) -> None:
    if window is not None and window < 1:
        raise InvalidRequest(f"sliding window must be >= 1 token, got {window}")
    if softcap is not None and not softcap > 0:
        raise InvalidRequest(f"attention softcap must be > 0, got {softcap}")
