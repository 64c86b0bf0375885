"""The reference path in torch ops: decode rows as one batched gather + SDPA (padded to the
longest context), each prefill chunk its own SDPA. Runs on any device; on CPU it is what runs
without a C++ compiler, and the native backend sends the chunks it keeps on SDPA here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpool.engine.attention.metadata import AttentionMetadata, _additive
from kvpool.engine.kv_quant import kv_values


def _mask_for(mask: Tensor | None, query: Tensor) -> Tensor | None:
    return mask if mask is None or mask.dtype == query.dtype else mask.to(query.dtype)


def torch_paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[Tensor, Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """The reference path: torch ops only (gathers whole contexts; decode rows padded to the
    longest one). Also what runs where the native kernel cannot be built."""
    if not meta.prefills:  # decode-only step: rows are the decode rows, in order
        return _decode_attention(query, k_cache, v_cache, meta, scale, window, softcap)
    out = torch.empty_like(query)
    if meta.num_decodes:
        out[meta.decode_rows] = _decode_attention(query, k_cache, v_cache, meta, scale, window, softcap)
    for index, chunk in enumerate(meta.prefills):
        out[chunk.start : chunk.end] = _prefill_chunk(query, k_cache, v_cache, meta, index, scale, new_kv, window, softcap)
    return out


def _prefill_chunk(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    index: int,
    scale: float,
    new_kv: tuple[Tensor, Tensor] | None,
    window: int | None,
    softcap: float | None,
) -> Tensor:
    """[q, H, D] of prefill chunk `index`: fresh prompts on the new K/V, others on gathered blocks."""
    chunk = meta.prefills[index]
    q = query[chunk.start : chunk.end].transpose(0, 1)  # [H, q, D]
    if not chunk.cached and new_kv is not None:
        k = new_kv[0][chunk.start : chunk.end].transpose(0, 1)
        v = new_kv[1][chunk.start : chunk.end].transpose(0, 1)
    else:
        blocks = meta.block_tables[chunk.seq, : chunk.num_blocks]
        k = _gather(k_cache, blocks, chunk.seq_len, query.dtype)
        v = _gather(v_cache, blocks, chunk.seq_len, query.dtype)
    unwindowed = window is None or window >= chunk.seq_len
    if chunk.cached and unwindowed and softcap is None and query.device.type == "cpu":
        return _attend_after_prefix(q[None], k[None], v[None], chunk.cached, scale)[0].transpose(0, 1)
    return _attend(q[None], k[None], v[None], meta.chunk_mask_for(index, window), scale, softcap)[0].transpose(0, 1)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float | None) -> Tensor:
    """q [B, H, M, D] over k, v [B, Hkv, N, D]; mask additive [.., M, N] or None for causal."""
    if softcap is None:
        # 4-D inputs take SDPA's fused CPU kernel; 3-D ones fall back to a slower path.
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=_mask_for(mask, q), is_causal=mask is None, scale=scale, enable_gqa=True
        )
    # SDPA cannot softcap: explicit scores in fp32, the query heads of one KV head side by side.
    b, h, m, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    qf = q.float().view(b, hkv, h // hkv, m, d)
    scores = qf @ k.float().unsqueeze(2).transpose(-1, -2) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        mask = _additive(torch.ones(m, n, dtype=torch.bool, device=q.device).tril(n - m))
    scores = scores + (mask.unsqueeze(1) if mask.dim() == 4 else mask).float()  # [B, 1, 1, M, N] or [M, N]
    out = scores.softmax(-1) @ v.float().unsqueeze(2)
    return out.view(b, h, m, d).to(q.dtype)


def _attend_after_prefix(q: Tensor, k: Tensor, v: Tensor, cached: int, scale: float) -> Tensor:
    """A chunk over `cached` earlier tokens without a mask: the prefix unmasked and the chunk
    itself causal, two fused CPU kernels (a [q, context] mask makes SDPA's one compute and
    read every masked score: ~1.6x slower), merged by their log-sum-exps."""
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, lse1 = sdpa(q, k[:, :, :cached], v[:, :, :cached], scale=scale)
    o2, lse2 = sdpa(q, k[:, :, cached:], v[:, :, cached:], is_causal=True, scale=scale)
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp_().unsqueeze(-1), (lse2 - top).exp_().unsqueeze(-1)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)


def _gather(cache: Tensor, blocks: Tensor, length: int, dtype: torch.dtype) -> Tensor:
    """[Hkv, length, D] K or V of one sequence, as `dtype` values."""
    hkv, d = cache.shape[-2:]
    return kv_values(cache.index_select(0, blocks).view(-1, hkv, d)[:length], dtype).transpose(0, 1)


def _decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> Tensor:
    """One query row per sequence, batched over sequences with a validity mask."""
    num, (hkv, width) = meta.num_decodes, k_cache.shape[-2:]
    span = meta.decode_blocks * meta.block_size
    k = kv_values(k_cache.index_select(0, meta.decode_block_ids).view(num, span, hkv, width), query.dtype)
    v = kv_values(v_cache.index_select(0, meta.decode_block_ids).view(num, span, hkv, width), query.dtype)
    k, v, d = k.transpose(1, 2), v.transpose(1, 2), query.shape[-1]
    # The G query heads sharing a KV head become G query rows of that head: no K/V repeat.
    group = query.shape[1] // hkv
    q = query if not meta.prefills else query.index_select(0, meta.decode_rows)
    q = q.view(num, hkv, group, d)
    o = _attend(q, k, v, meta.decode_mask_for(window), scale, softcap)
    return o.reshape(num, hkv * group, d)
