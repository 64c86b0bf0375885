"""Paged attention against plain contiguous causal attention on ragged, shuffled-block batches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.attention import AttentionMetadata, paged_attention, write_kv
from kvpool.errors import InvalidRequest

H, HKV, D = 6, 2, 16


def contiguous_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [n, H, D] are the last n positions of a context k, v [L, HKV, D]; causal, GQA by repeat.
    Window and softcap written as HF transformers does (masking_utils.sliding_window_overlay:
    kv_idx > q_idx - sliding_window; Gemma 2's eager attention: tanh before the mask)."""
    n, length = q.shape[0], k.shape[0]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    kv_idx, q_idx = torch.arange(length)[None, :], torch.arange(length - n, length)[:, None]
    allowed = kv_idx <= q_idx
    if window is not None:
        allowed &= kv_idx > q_idx - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(
    cached: list[int],
    new: list[int],
    block_size: int,
    seed: int,
    use_new_kv: bool = True,
    window: int | None = None,
    softcap: float | None = None,
):
    """Max abs diff between paged and contiguous attention for sequences with `cached` tokens
    already in the cache and `new` tokens arriving this step."""
    gen = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(cached, new, strict=True)]
    need = [-(-t // block_size) for t in totals]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    k_cache = torch.randn(num_blocks, block_size, HKV, D, generator=gen)  # garbage everywhere
    v_cache = torch.randn(num_blocks, block_size, HKV, D, generator=gen)
    ks = [torch.randn(t, HKV, D, generator=gen) for t in totals]
    vs = [torch.randn(t, HKV, D, generator=gen) for t in totals]
    qs = [torch.randn(n, H, D, generator=gen) for n in new]
    for c, k, v, table in zip(cached, ks, vs, tables, strict=True):
        if c:  # earlier steps put the cached prefix in place
            pre = AttentionMetadata.build([c], [c], [table], block_size)
            write_kv(k[:c], v[:c], k_cache, v_cache, pre.slot_mapping)
    meta = AttentionMetadata.build(new, totals, tables, block_size)
    new_k = torch.cat([k[c:] for c, k in zip(cached, ks, strict=True)])
    new_v = torch.cat([v[c:] for c, v in zip(cached, vs, strict=True)])
    write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    scale = 1 / math.sqrt(D)
    out = paged_attention(
        torch.cat(qs), k_cache, v_cache, meta, scale, new_kv=(new_k, new_v) if use_new_kv else None,
        window=window, softcap=softcap,
    )
    ref = torch.cat(
        [contiguous_attention(q, k, v, scale, window, softcap) for q, k, v in zip(qs, ks, vs, strict=True)]
    )
    return (out - ref).abs().max().item()


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
@pytest.mark.parametrize("use_new_kv", [True, False])
def test_paged_equals_contiguous_on_mixed_prefill_chunks_and_decodes(block_size, use_new_kv):
    cached = [0, 37, 0, 5, 120, 0, 64, 3]  # fresh prompts, chunks after cached context, decodes
    new = [23, 11, 1, 1, 1, 9, 1, 70]
    assert run_case(cached, new, block_size, seed=block_size, use_new_kv=use_new_kv) <= 1e-5


@pytest.mark.parametrize("window", [None, 1, 7, 64, 500])
@pytest.mark.parametrize("softcap", [None, 0.5, 50.0])
@pytest.mark.parametrize("use_new_kv", [True, False])
def test_window_and_softcap_match_the_hf_convention(window, softcap, use_new_kv):
    cached = [0, 37, 0, 5, 120, 0, 64, 3]
    new = [23, 11, 1, 1, 1, 9, 1, 70]
    err = run_case(cached, new, 16, seed=3, use_new_kv=use_new_kv, window=window, softcap=softcap)
    assert err <= 1e-5


def test_window_one_attends_to_the_token_itself_only():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(4, 4, HKV, D, generator=gen), torch.randn(4, 4, HKV, D, generator=gen)
    meta = AttentionMetadata.build([5, 1], [5, 3], [[0, 1], [2]], 4)
    out = paged_attention(torch.randn(6, H, D, generator=gen), k_cache, v_cache, meta, 0.25, window=1)
    v_rows = v_cache.view(-1, HKV, D)[meta.slot_mapping].repeat_interleave(H // HKV, dim=1)
    assert torch.allclose(out, v_rows, atol=1e-6)


def test_bad_window_and_softcap_are_refused():
    meta = AttentionMetadata.build([1], [1], [[0]], 4)
    cache = torch.zeros(1, 4, HKV, D)
    with pytest.raises(InvalidRequest, match="window"):
        paged_attention(torch.zeros(1, H, D), cache, cache, meta, 1.0, window=0)
    with pytest.raises(InvalidRequest, match="softcap"):
        paged_attention(torch.zeros(1, H, D), cache, cache, meta, 1.0, softcap=-1.0)


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 2, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_contiguous_on_random_ragged_batches(seqs, block_size, seed):
    cached, new = [c for c, _ in seqs], [n for _, n in seqs]
    assert run_case(cached, new, block_size, seed) <= 1e-5


def test_sequence_reads_shared_block_written_by_another_sequence_in_the_same_step():
    block_size, gen = 4, torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, block_size, HKV, D, generator=gen)
    v_cache = torch.randn(6, block_size, HKV, D, generator=gen)
    k, v = torch.randn(9, HKV, D, generator=gen), torch.randn(9, HKV, D, generator=gen)
    # A prefills 8 tokens into blocks [5, 2]; B shares them and adds its 9th token in block 0.
    meta = AttentionMetadata.build([8, 1], [8, 9], [[5, 2], [5, 2, 0]], block_size)
    new_k, new_v = torch.cat([k[:8], k[8:]]), torch.cat([v[:8], v[8:]])
    write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(9, H, D, generator=gen)
    out = paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert (out[8:] - contiguous_attention(q[8:], k, v, 0.25)).abs().max() <= 1e-5


def test_build_places_tokens_at_their_positions_and_slots():
    meta = AttentionMetadata.build([3, 1], [5, 7], [[9, 4], [1, 0]], 4)
    assert meta.positions.tolist() == [2, 3, 4, 6]
    assert meta.slot_mapping.tolist() == [9 * 4 + 2, 9 * 4 + 3, 4 * 4 + 0, 0 * 4 + 2]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.num_decodes == 1 and meta.decode_rows.tolist() == [3]


def test_build_rejects_context_longer_than_its_blocks():
    with pytest.raises(InvalidRequest, match="seq_len=9"):
        AttentionMetadata.build([1], [9], [[0, 1]], 4)
    with pytest.raises(InvalidRequest, match="query_len=3"):
        AttentionMetadata.build([3], [2], [[0]], 4)
