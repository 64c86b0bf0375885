"""Paged attention: K/V live in fixed-size blocks addressed through per-sequence block tables.

Every layer first writes the step's new K/V into their slots, then attends, so a sequence may
read a block another sequence of the same batch has just written (shared prefix blocks).
CPU path: decode rows (one new token) run as one batched gather + SDPA; each prefill chunk runs
its own SDPA (fresh prompts straight on the new K/V, chunks with cached context on gathered
blocks). CUDA path: a small Triton kernel when triton is importable.

Sliding window W (HF transformers' `sliding_window`, Mistral / Gemma 2 / Gemma 3): a query at
position p sees key positions k with p - W < k <= p, i.e. W keys counting itself. Logit softcap
c (Gemma 2): scores s = scale * q.k become c * tanh(s / c) before the mask and the softmax.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpool.errors import InvalidRequest

logger = logging.getLogger(__name__)

KVCache = tuple[Tensor, Tensor]


@dataclass(slots=True)
class PrefillChunk:
    """One sequence with more than one new token; python ints so layers need no host syncs."""

    seq: int
    start: int  # first input row
    end: int  # one past the last input row
    seq_len: int  # context length after this step
    num_blocks: int  # blocks covering seq_len
    mask: Tensor | None  # [qlen, seq_len] additive (0 / -inf), None when the chunk is the whole context


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
    windowed_masks: dict = field(default_factory=dict)  # (what, window) -> mask, built once per step

    def decode_mask_for(self, window: int | None) -> Tensor:
        """The decode mask that also hides keys at or before position seq_len - 1 - window."""
        if window is None:
            return self.decode_mask
        key = ("decode", window)
        if key not in self.windowed_masks:
            span = self.decode_mask.shape[-1]
            lens = self.decode_seq_lens.unsqueeze(1)
            ar = torch.arange(span, device=lens.device)
            allowed = (ar < lens) & (ar >= lens - window)
            self.windowed_masks[key] = _additive(allowed).view(-1, 1, 1, span)
        return self.windowed_masks[key]

    def chunk_mask_for(self, index: int, window: int | None) -> Tensor | None:
        """Prefill chunk `index`'s mask [qlen, seq_len]; None means plain causal over new K/V."""
        chunk = self.prefills[index]
        if window is None or window >= chunk.seq_len:
            return chunk.mask
        key = (index, window)
        if key not in self.windowed_masks:
            s, q = chunk.seq_len, chunk.end - chunk.start
            keys = torch.arange(s, device=self.seq_lens.device).unsqueeze(0)
            pos = torch.arange(s - q, s, device=self.seq_lens.device).unsqueeze(1)
            self.windowed_masks[key] = _additive((keys <= pos) & (pos - keys < window))
        return self.windowed_masks[key]

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
        num_seqs = len(query_lens)
        width = max(len(bt) for bt in block_tables)
        bt_t = torch.zeros((num_seqs, width), dtype=torch.int64)
        for i, bt in enumerate(block_tables):
            bt_t[i, : len(bt)] = torch.tensor(bt, dtype=torch.int64)
        q_t = torch.tensor(query_lens, dtype=torch.int64)
        s_t = torch.tensor(seq_lens, dtype=torch.int64)
        qsl = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(q_t, 0, out=qsl[1:])
        total = int(qsl[-1])
        token_seq = torch.repeat_interleave(torch.arange(num_seqs), q_t)
        positions = torch.arange(total) - qsl[token_seq] + (s_t - q_t)[token_seq]
        slots = bt_t[token_seq, positions // block_size] * block_size + positions % block_size

        dec = [i for i, q in enumerate(query_lens) if q == 1]
        dec_t = torch.tensor(dec, dtype=torch.int64)
        dec_max = max((seq_lens[i] for i in dec), default=0)
        dec_blocks = -(-dec_max // block_size)
        span = dec_blocks * block_size
        # Additive float masks: SDPA's CPU kernel takes a much slower path for boolean ones.
        dec_mask = _additive((torch.arange(span) < s_t[dec_t].unsqueeze(1)).view(len(dec), 1, 1, span))
        prefills = []
        for i, q in enumerate(query_lens):
            if q == 1:
                continue
            s, start = seq_lens[i], int(qsl[i])
            mask = None
            if s != q:  # cached context: token j sees positions <= s - q + j
                mask = _additive(torch.arange(s).unsqueeze(0) <= torch.arange(s - q, s).unsqueeze(1))
                mask = mask.to(device)
            prefills.append(PrefillChunk(i, start, start + q, s, -(-s // block_size), mask))
        return cls(
            slot_mapping=slots.to(device),
            query_start_loc=qsl.to(device),
            seq_lens=s_t.to(device),
            block_tables=bt_t.to(device),
            block_size=block_size,
            positions=positions.to(device),
            token_seq=token_seq.to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            decode_rows=qsl[dec_t].to(device),
            decode_block_ids=bt_t[dec_t, :dec_blocks].reshape(-1).to(device),
            decode_blocks=dec_blocks,
            decode_mask=dec_mask.to(device),
            decode_seq_lens=s_t[dec_t].to(device),
            prefills=prefills,
        )


def _additive(allowed: Tensor) -> Tensor:
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _mask_for(mask: Tensor | None, query: Tensor) -> Tensor | None:
    return mask if mask is None or mask.dtype == query.dtype else mask.to(query.dtype)


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Scatter [T, Hkv, D] key/value rows into their flat slots."""
    hkv, d = k_cache.shape[-2:]
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
    if query.is_cuda and window is None and softcap is None and _triton_usable(k_cache, meta.block_size):
        return _triton_paged_attention(query, k_cache, v_cache, meta, scale)
    return torch_paged_attention(query, k_cache, v_cache, meta, scale, new_kv, window, softcap)


def _check_window_softcap(window: int | None, softcap: float | None) -> None:
    if window is not None and window < 1:
        raise InvalidRequest(f"sliding window must be >= 1 token, got {window}")
    if softcap is not None and not softcap > 0:
        raise InvalidRequest(f"attention softcap must be > 0, got {softcap}")


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
        q = query[chunk.start : chunk.end].transpose(0, 1)  # [H, q, D]
        mask = meta.chunk_mask_for(index, window)
        if chunk.mask is None and new_kv is not None:
            k = new_kv[0][chunk.start : chunk.end].transpose(0, 1)
            v = new_kv[1][chunk.start : chunk.end].transpose(0, 1)
        else:
            blocks = meta.block_tables[chunk.seq, : chunk.num_blocks]
            k = _gather(k_cache, blocks, chunk.seq_len)
            v = _gather(v_cache, blocks, chunk.seq_len)
        out[chunk.start : chunk.end] = _attend(q[None], k[None], v[None], mask, scale, softcap)[0].transpose(0, 1)
    return out


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


def _gather(cache: Tensor, blocks: Tensor, length: int) -> Tensor:
    """[Hkv, length, D] K or V of one sequence."""
    hkv, d = cache.shape[-2:]
    return cache.index_select(0, blocks).view(-1, hkv, d)[:length].transpose(0, 1)


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
    num, (hkv, d) = meta.num_decodes, k_cache.shape[-2:]
    span = meta.decode_blocks * meta.block_size
    k = k_cache.index_select(0, meta.decode_block_ids).view(num, span, hkv, d).transpose(1, 2)
    v = v_cache.index_select(0, meta.decode_block_ids).view(num, span, hkv, d).transpose(1, 2)
    # The G query heads sharing a KV head become G query rows of that head: no K/V repeat.
    group = query.shape[1] // hkv
    q = query if not meta.prefills else query.index_select(0, meta.decode_rows)
    q = q.view(num, hkv, group, d)
    o = _attend(q, k, v, meta.decode_mask_for(window), scale, softcap)
    return o.reshape(num, hkv * group, d)


def _triton_usable(k_cache: Tensor, block_size: int) -> bool:
    d = k_cache.shape[-1]
    pow2 = (block_size & (block_size - 1)) == 0 and (d & (d - 1)) == 0
    return k_cache.is_cuda and pow2 and block_size >= 16 and _triton_kernel() is not None


@cache
def _triton_kernel() -> Any:
    """The compiled kernel, or None when triton is missing (then the torch path runs on CUDA)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        logger.info("triton not importable; CUDA paged attention uses the torch path")
        return None

    @triton.jit
    def kernel(
        Q,
        K,
        V,
        Out,
        BT,
        SEQ,
        POS,
        scale,
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
    ):
        # One program per (query token, head): online softmax over the token's context blocks.
        t = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        seq = tl.load(SEQ + t)
        n_ctx = tl.load(POS + t) + 1
        d = tl.arange(0, HEAD_DIM)
        offs = tl.arange(0, BLOCK)
        q = tl.load(Q + t * sq_t + h * sq_h + d).to(tl.float32)
        m = -float("inf")
        denom = 0.0
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for b in range(0, tl.cdiv(n_ctx, BLOCK)):
            blk = tl.load(BT + seq * sbt + b)
            valid = b * BLOCK + offs < n_ctx
            base = blk * sk_b + offs[:, None] * sk_s + kvh * sk_h + d[None, :]
            k = tl.load(K + base, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(V + base, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.where(valid, tl.sum(k * q[None, :], 1) * scale, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m = m_new
        tl.store(Out + t * so_t + h * so_h + d, (acc / denom).to(Out.dtype.element_ty))

    return kernel


def _triton_paged_attention(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    kernel = _triton_kernel()
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
    )
    return out
