"""One step's attention metadata: where each new token's K/V goes (slots), what each sequence
attends to (block tables, lengths), and the plan the backends share (decode rows, prefill
chunks, which chunks keep SDPA). Built once per step from python ints: a decode step's metadata
is a few dozen numbers, far cheaper to compute here than as torch ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvpool.engine.kernels import batch_invariant
from kvpool.errors import InvalidRequest

KVCache = tuple[Tensor, Tensor]
SDPA_MIN = 64  # prefill chunks at least this long run on SDPA's fused kernel


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
