"""Paged attention: K/V live in fixed-size blocks addressed through per-sequence block tables.

Every layer first writes the step's new K/V into their slots, then attends, so a sequence may
read a block another sequence of the same batch has just written (shared prefix blocks).
CPU path: a native kernel (kernels/paged_attention.cpp) runs decode rows and prefill chunks,
each row reading only its own context through its block table, its keys in tiles and parts at
fixed positions: a row's result is the same bits whether its keys were computed in this step,
an earlier chunk or came from a cache hit (docs/determinism.md). With KVPOOL_BATCH_INVARIANT=0
(for comparison only), chunks of `SDPA_MIN`
tokens or more keep SDPA's fused kernel (matmul-bound there; the kernel wins below 48-64 tokens,
measured): fresh prompts on the new K/V, chunks over a cached prefix on their own gathered
blocks, a copy of O(context) amortized over >= SDPA_MIN query rows (unmasked against the
prefix, causal against themselves, merged by log-sum-exp). Without a
compiler the torch path runs instead: decode rows as one batched gather + SDPA (padded to the
longest context), each prefill chunk its own SDPA. CUDA path: a small Triton kernel when triton
is importable.

Sliding window W (HF transformers' `sliding_window`, Mistral / Gemma 2 / Gemma 3): a query at
position p sees key positions k with p - W < k <= p, i.e. W keys counting itself. Logit softcap
c (Gemma 2): scores s = scale * q.k become c * tanh(s / c) before the mask and the softmax.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpool.engine.kernels import batch_invariant, paged_attention_available
from kvpool.engine.kv_quant import is_quantized, kv_values, quantize
from kvpool.errors import InvalidRequest

logger = logging.getLogger(__name__)

KVCache = tuple[Tensor, Tensor]
SDPA_MIN = 64  # prefill chunks at least this long run on SDPA's fused kernel
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
_NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)  # uint8: fp8 e4m3 bits


@dataclass(slots=True)
class PrefillChunk:
    """One sequence with more than one new token; python ints so layers need no host syncs."""

    seq: int
    start: int  # first input row
    end: int  # one past the last input row
    seq_len: int  # context length after this step
    num_blocks: int  # blocks covering seq_len

    @property
    def cached(self) -> int:
        """Context tokens before this chunk (0: a fresh prompt, attending to its new K/V only)."""
        return self.seq_len - (self.end - self.start)


@dataclass(slots=True)
class AttentionMetadata:
    """Where each input token's K/V goes and what each sequence attends to, for one step."""

    slot_mapping: Tensor  # [T] flat slot = block_id * block_size + offset
    query_start_loc: Tensor  # [S+1]
    seq_lens: Tensor  # [S] context length after this step
    block_tables: Tensor  # [S, max_blocks], padded with 0
    block_size: int
    positions: Tensor  # [T] position of each input token in its sequence
    token_seq: Tensor  # [T] sequence index of each input token
    max_query_len: int
    max_seq_len: int
    decode_rows: Tensor  # [Sd] input rows of sequences with exactly one new token
    decode_block_ids: Tensor  # [Sd * decode_blocks] their block ids, flattened
    decode_blocks: int  # blocks gathered per decode row
    decode_mask: Tensor  # [Sd, 1, 1, decode_blocks * block_size] additive: 0 in context, -inf past it
    decode_seq_lens: Tensor  # [Sd] context length of each decode row
    prefills: list[PrefillChunk] = field(default_factory=list)
    native_seqs: Tensor | None = None  # [N] sequences the native kernel runs (CPU int64)
    sdpa_chunks: list[int] = field(default_factory=list)  # indices into prefills that keep SDPA
    masks: dict = field(default_factory=dict)  # (what, window) -> mask, built on first use in a step
    layer_metas: list[AttentionMetadata] | None = None  # per layer, when layer groups have their own tables

    def for_layer(self, layer: int) -> AttentionMetadata:
        """Layer `layer`'s metadata: its group's block tables and slots (self without groups)."""
        return self if self.layer_metas is None else self.layer_metas[layer]

    def decode_mask_for(self, window: int | None) -> Tensor:
        """The decode mask that also hides keys at or before position seq_len - 1 - window."""
        if window is None:
            return self.decode_mask
        key = ("decode", window)
        if key not in self.masks:
            span = self.decode_mask.shape[-1]
            lens = self.decode_seq_lens.unsqueeze(1)
            ar = torch.arange(span, device=lens.device)
            allowed = (ar < lens) & (ar >= lens - window)
            self.masks[key] = _additive(allowed).view(-1, 1, 1, span)
        return self.masks[key]

    def chunk_mask_for(self, index: int, window: int | None) -> Tensor | None:
        """Prefill chunk `index`'s additive mask [qlen, seq_len] (token j sees positions
        <= cached + j, and > cached + j - window); None means plain causal over new K/V."""
        chunk = self.prefills[index]
        if window is not None and window >= chunk.seq_len:
            window = None
        if window is None and not chunk.cached:
            return None
        key = (index, window)
        if key not in self.masks:
            s, q = chunk.seq_len, chunk.end - chunk.start
            keys = torch.arange(s, device=self.seq_lens.device).unsqueeze(0)
            pos = torch.arange(s - q, s, device=self.seq_lens.device).unsqueeze(1)
            allowed = keys <= pos if window is None else (keys <= pos) & (pos - keys < window)
            self.masks[key] = _additive(allowed)
        return self.masks[key]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> AttentionMetadata:
        """Compute slots, positions and the per-group plan from per-sequence lengths."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
            raise InvalidRequest(
                f"need one query_len, seq_len and block table per sequence, got "
                f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
            )
        for i, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
            if q < 1 or s < q:
                raise InvalidRequest(f"sequence {i}: query_len={q} must be in 1..seq_len={s}")
            if len(bt) * block_size < s:
                raise InvalidRequest(
                    f"sequence {i}: seq_len={s} exceeds its {len(bt)} blocks x {block_size} slots"
                )
        # Per-token lists in python, then one tensor for every int64 field: a decode step's
        # metadata is a few dozen numbers, far cheaper to compute here than as torch ops.
        num_seqs = len(query_lens)
        width = max(len(bt) for bt in block_tables)
        qsl = [0]
        positions: list[int] = []
        slots: list[int] = []
        token_seq: list[int] = []
        for i, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
            qsl.append(qsl[-1] + q)
            positions.extend(range(s - q, s))
            token_seq.extend([i] * q)
            p = s - q
            while p < s:  # the run of slots in each block the new tokens fill
                b, off = divmod(p, block_size)
                n = min(block_size - off, s - p)
                base = max(bt[b], 0) * block_size
                slots.extend(range(base + off, base + off + n))
                p += n
        dec = [i for i, q in enumerate(query_lens) if q == 1]
        dec_max = max((seq_lens[i] for i in dec), default=0)
        dec_blocks = -(-dec_max // block_size)
        dec_ids = [b for i in dec for b in (block_tables[i] + [0] * dec_blocks)[:dec_blocks]]
        prefills = []
        for i, q in enumerate(query_lens):
            if q == 1:
                continue
            s, start = seq_lens[i], qsl[i]
            prefills.append(PrefillChunk(i, start, start + q, s, -(-s // block_size)))
        # batch-invariant: every chunk on the native kernel, whose sums follow a row's own positions
        sdpa_min = SDPA_MIN if not batch_invariant() else None
        sdpa_chunks = [j for j, c in enumerate(prefills) if sdpa_min is not None and c.end - c.start >= sdpa_min]
        on_sdpa = {prefills[j].seq for j in sdpa_chunks}
        native = [i for i in range(num_seqs) if i not in on_sdpa]
        parts = (slots, qsl, seq_lens, positions, token_seq, [qsl[i] for i in dec], dec_ids,
                 [seq_lens[i] for i in dec], native, [b for bt in block_tables for b in bt + [0] * (width - len(bt))])
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.int64)
        views, at = [], 0
        for part in parts:
            views.append(flat[at : at + len(part)])
            at += len(part)
        slots_t, qsl_t, s_t, pos_t, seq_t, dec_rows, dec_ids_t, dec_lens, native_t, bt_flat = views
        bt_t = bt_flat.view(num_seqs, width).clamp_(min=0)  # a window group's freed blocks (-1): masked or skipped
        dec_ids_t.clamp_(min=0)
        span = dec_blocks * block_size
        # Additive float masks: SDPA's CPU kernel takes a much slower path for boolean ones.
        dec_mask = _additive((torch.arange(span) < dec_lens.unsqueeze(1)).view(len(dec), 1, 1, span))
        on_cpu = torch.device(device).type == "cpu"

        def put(t: Tensor) -> Tensor:
            return t if on_cpu else t.to(device)

        return cls(
            slot_mapping=put(slots_t),
            query_start_loc=put(qsl_t),
            seq_lens=put(s_t),
            block_tables=put(bt_t),
            block_size=block_size,
            positions=put(pos_t),
            token_seq=put(seq_t),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            decode_rows=put(dec_rows),
            decode_block_ids=put(dec_ids_t),
            decode_blocks=dec_blocks,
            decode_mask=put(dec_mask),
            decode_seq_lens=put(dec_lens),
            prefills=prefills,
            native_seqs=native_t,
            sdpa_chunks=sdpa_chunks,
        )


def _additive(allowed: Tensor) -> Tensor:
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _mask_for(mask: Tensor | None, query: Tensor) -> Tensor | None:
    return mask if mask is None or mask.dtype == query.dtype else mask.to(query.dtype)


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
    """[T, H, D] attention output. `new_kv` (this step's K/V rows) lets fresh prompts skip the
    gather; results are the same without it. `window` / `softcap`: see the module docstring."""
    _check_window_softcap(window, softcap)
    if is_quantized(k_cache):
        new_kv = None  # attend to the stored (quantized) K/V, so a prefix hit reads what a miss did
    elif query.is_cuda:
        from kvpool.engine.kernels import triton_attention

        if triton_attention.triton_usable(k_cache, meta.block_size):
            return triton_attention.triton_paged_attention(query, k_cache, v_cache, meta, scale, window, softcap)
    if _native_usable(query, k_cache):
        return native_paged_attention(query, k_cache, v_cache, meta, scale, new_kv, window, softcap)
    return torch_paged_attention(query, k_cache, v_cache, meta, scale, new_kv, window, softcap)


def _check_window_softcap(window: int | None, softcap: float | None) -> None:
    if window is not None and window < 1:
        raise InvalidRequest(f"sliding window must be >= 1 token, got {window}")
    if softcap is not None and not softcap > 0:
        raise InvalidRequest(f"attention softcap must be > 0, got {softcap}")


def _native_usable(query: Tensor, k_cache: Tensor) -> bool:
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
