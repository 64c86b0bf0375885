"""The native decode loop: a decode-sized step through the whole layer stack as one C++ op
(`kernels/layer_loop.cpp`), a fast path the model selects per step beside its Python layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from kvpool.engine.attention import AttentionMetadata, KVCache
from kvpool.engine.kernels import decode_loop_available
from kvpool.engine.layers import fused_ops
from kvpool.engine.layers.linear import Q4Linear, Q4TileLinear
from kvpool.engine.layers.norm import RMSNorm
from kvpool.engine.models.config import ModelConfig


class DecodeLoop:
    """The same kernels the Python layers call on CPU rows (fused norms with the residual
    carried, 4-bit projections, fused RoPE + K/V write, native attention, fused SiLU * up), in
    their order, so the same bits, without ~13 Python-dispatched calls per layer. It takes a
    step when every projection serves its rows from 4-bit groups (so the rows are not padded
    either) and every sequence is on the native attention kernel (`build` checks the rest)."""

    def __init__(
        self, weights: list[Tensor], local_layers: list[int], windows: list[int], final_norm: Tensor,
        heads: int, kv_heads: int, scale: float, softcap: float, eps: float, limits: Q4Linear,
    ) -> None:
        self.weights, self.local_layers, self.windows, self.final_norm = weights, local_layers, windows, final_norm
        self.heads, self.kv_heads, self.scale, self.softcap, self.eps = heads, kv_heads, scale, softcap, eps
        self.limits = limits  # the projections' shared row limits, read per step as Q4Linear.forward does
        self._caches: tuple[list[KVCache], list[Tensor]] = ([], [])  # (the runner's cache list, flattened)

    @classmethod
    def build(cls, config: ModelConfig, layers: Sequence[nn.Module], final_norm: RMSNorm) -> DecodeLoop | None:
        """The loop over Llama layers (`models/llama.py`), where every layer can take it:
        Llama-style norms and SiLU, no q/k norms, full rotary, all four projections on 4-bit
        groups without bias, one set of row limits and one norm epsilon."""
        plain = not (config.sandwich_norms or config.norm_offset or config.qk_norm) and config.hidden_act == "silu"
        if not (plain and layers and decode_loop_available()) or (config.rotary_dim or config.head_dim) != config.head_dim:
            return None
        weights: list[Tensor] = []
        limits, eps, kinds = set(), {final_norm.eps}, set()
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            projs = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(type(p) in (Q4Linear, Q4TileLinear) and p.bias is None for p in projs):
                return None
            kinds |= {type(p) for p in projs}
            limits |= {(p.max_rows, p.vector_rows) for p in projs}
            eps |= {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
            weights += [layer.input_layernorm.weight, *attn.qkv_proj.groups, *attn.o_proj.groups,
                        layer.post_attention_layernorm.weight, *mlp.gate_up_proj.groups, *mlp.down_proj.groups]
        if len(limits) != 1 or len(eps) != 1 or len(kinds) != 1:
            return None
        attn = layers[0].self_attn
        return cls(
            [w.detach() for w in weights], [int(layer.local_rope) for layer in layers],
            [layer.self_attn.window or 0 for layer in layers], final_norm.weight.detach(),
            attn.num_heads, attn.num_kv_heads, attn.scale, attn.softcap or 0.0, eps.pop(), attn.qkv_proj,
        )

    def takes(self, x: Tensor, kv_caches: list[KVCache], meta: AttentionMetadata) -> bool:
        """Whether this step can run here (else the Python layers run it)."""
        k_cache = kv_caches[0][0]
        return (
            x.shape[0] <= self.limits.max_rows
            and not meta.sdpa_chunks
            and meta.layer_metas is None
            and fused_ops.usable(x)
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
            self.heads, self.kv_heads, self.scale, self.softcap, self.eps, self._kernel(x.shape[0]),
        )

    def _kernel(self, rows: int) -> int:
        """The projections' kernel for `rows`, as Q4Linear.forward picks it (layer_loop.cpp)."""
        if type(self.limits) is Q4TileLinear:
            return 2
        return int(rows > self.limits.vector_rows)
