"""Ragged paged-attention batches over shuffled (and shared) blocks, for the kernel tests."""

from __future__ import annotations

import torch

from kvpool.engine.attention import AttentionMetadata, write_kv

D = 64


def make_batch(
    cached: list[int],
    new: list[int],
    block_size: int,
    kv_heads: int,
    group: int,
    dtype: torch.dtype,
    seed: int,
    share: list[int | None] | None = None,
    head_dim: int = D,
):
    """A cache of shuffled blocks holding each sequence's context; sequence i with share[i] = j
    reuses sequence j's full cached blocks as its own prefix (a fork), then owns the rest."""
    D = head_dim
    gen = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(cached, new, strict=True)]
    num_blocks = sum(-(-t // block_size) for t in totals) + 4
    free = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, D, generator=gen).to(dtype)
    tables: list[list[int]] = []
    for i, t in enumerate(totals):
        parent = share[i] if share else None
        shared = tables[parent][: min(cached[i], cached[parent]) // block_size] if parent is not None else []
        own = [free.pop() for _ in range(-(-t // block_size) - len(shared))]
        tables.append(shared + own)
    for i, c in enumerate(cached):
        if c:
            pre = AttentionMetadata.build([c], [c], [tables[i]], block_size)
            k = torch.randn(c, kv_heads, D, generator=gen).to(dtype)
            write_kv(k, torch.randn(c, kv_heads, D, generator=gen).to(dtype), k_cache, v_cache, pre.slot_mapping)
    meta = AttentionMetadata.build(new, totals, tables, block_size)
    rows = sum(new)
    new_k = torch.randn(rows, kv_heads, D, generator=gen).to(dtype)
    new_v = torch.randn(rows, kv_heads, D, generator=gen).to(dtype)
    write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    query = torch.randn(rows, kv_heads * group, D, generator=gen).to(dtype)
    return query, k_cache, v_cache, meta, (new_k, new_v)
