"""Steps through fused per-layer ops (`engine/kernels/fused_ops.cpp`).

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

from kvpool.engine.attention import AttentionMetadata, KVCache
from kvpool.engine.kernels import fused_ops_available
from kvpool.engine.models.quantized import Q4Linear


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


class DecodeLoop:
    """A decode-sized step's layer loop as one native op (`kernels/layer_loop.cpp`): the same
    kernels `LlamaLayer.fused_forward` calls, in its order, so the same bits, without ~13
    Python-dispatched calls per layer. It takes a step when every projection serves its rows
    from 4-bit groups (so the rows are not padded either) and every sequence is on the native
    attention kernel
    (the model checks the rest when it builds the loop: see `LlamaForCausal._decode_loop`)."""

    def __init__(
        self, weights: list[Tensor], local_layers: list[int], windows: list[int], final_norm: Tensor,
        heads: int, kv_heads: int, scale: float, softcap: float, eps: float, limits: Q4Linear,
    ) -> None:
        self.weights, self.local_layers, self.windows, self.final_norm = weights, local_layers, windows, final_norm
        self.heads, self.kv_heads, self.scale, self.softcap, self.eps = heads, kv_heads, scale, softcap, eps
        self.limits = limits  # the projections' shared row limits, read per step as Q4Linear.forward does
        self._caches: tuple[list[KVCache], list[Tensor]] = ([], [])  # (the runner's cache list, flattened)

    def takes(self, x: Tensor, kv_caches: list[KVCache], meta: AttentionMetadata) -> bool:
        """Whether this step can run here (else the Python loop runs it)."""
        k_cache = kv_caches[0][0]
        return (
            x.shape[0] <= self.limits.max_rows
            and not meta.sdpa_chunks
            and meta.layer_metas is None
            and usable(x)
            and k_cache.dtype == x.dtype
            and k_cache.is_contiguous()
        )

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], local: tuple[Tensor, Tensor], kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> Tensor:
        if self._caches[0] is not kv_caches:
            self._caches = (kv_caches, [t for pair in kv_caches for t in pair])
        return torch.ops.kvpool_loop.decode_layers(
            x, self.weights, self._caches[1], *rope, *local, self.local_layers, self.windows, self.final_norm,
            meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.native_seqs,
            self.heads, self.kv_heads, self.scale, self.softcap, self.eps, x.shape[0] > self.limits.vector_rows,
        )
