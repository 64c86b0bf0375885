"""The native CPU paged-attention kernel against the torch path it replaces, on ragged batches."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import D, make_batch

from kvpool.engine.attention import native_paged_attention, torch_paged_attention
from kvpool.engine.kernels import paged_attention_available

pytestmark = pytest.mark.skipif(
    not paged_attention_available(), reason="no C++ compiler to build the native attention kernel"
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def max_diff(batch, window=None, softcap=None) -> float:
    query, k_cache, v_cache, meta, new_kv = batch
    args = (query, k_cache, v_cache, meta, D**-0.5, new_kv, window, softcap)
    native = native_paged_attention(*args)
    ref = torch_paged_attention(*args)
    return (native.float() - ref.float()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3), (2, 4)])
def test_decode_rows_with_contexts_from_1_to_4100(dtype, block_size, kv_heads, group):
    cached = [0, 1, 15, 16, 17, 63, 200, 1023, 4099]
    batch = make_batch(cached, [1] * len(cached), block_size, kv_heads, group, dtype, seed=block_size)
    assert max_diff(batch) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3), (2, 4)])
def test_mixed_prefill_chunks_and_decodes(dtype, block_size, kv_heads, group):
    # fresh prompts short (native) and long (SDPA), chunks over cached prefixes, decodes
    cached = [0, 37, 0, 5, 300, 0, 64, 3, 700]
    new = [23, 11, 1, 1, 1, 90, 1, 70, 130]
    batch = make_batch(cached, new, block_size, kv_heads, group, dtype, seed=7 + block_size)
    assert max_diff(batch) <= TOL[dtype]


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_forked_sequences_read_shared_blocks(block_size):
    # 1, 2 fork 0's prefix; 3 forks 2 (which shares 0's blocks): decodes and chunks over them
    cached, new = [256, 256, 300, 280, 0], [1, 1, 17, 1, 5]
    batch = make_batch(cached, new, block_size, 3, 3, torch.float32, seed=3, share=[None, 0, 0, 2, None])
    assert len({b for t in batch[3].block_tables.tolist() for b in t[:4]}) < 16  # blocks really shared
    assert max_diff(batch) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(1, None), (33, None), (512, None), (None, 30.0), (100, 0.7)])
def test_window_and_softcap(dtype, window, softcap):
    cached = [0, 37, 0, 600, 4099, 64, 3]
    new = [23, 11, 100, 1, 1, 70, 1]
    batch = make_batch(cached, new, 16, 3, 3, dtype, seed=11)
    assert max_diff(batch, window, softcap) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(128, 2, 4), (256, 1, 4), (128, 2, 1)])
def test_wider_heads(dtype, head_dim, kv_heads, group):
    """Head dims of 128 (Llama, Qwen, Mistral) and 256 (Gemma) run their own kernel forms: chunks
    over cached prefixes and decode rows against the torch path, and a decode row's bits equal
    its row in a chunk."""
    cached, new = [0, 37, 300, 700, 5], [40, 11, 1, 1, 70]
    query, k_cache, v_cache, meta, new_kv = make_batch(cached, new, 16, kv_heads, group, dtype, seed=head_dim,
                                                       head_dim=head_dim)
    args = (query, k_cache, v_cache, meta, head_dim**-0.5, new_kv)
    native = native_paged_attention(*args)
    assert (native.float() - torch_paged_attention(*args).float()).abs().max().item() <= TOL[dtype]
    table = meta.block_tables[4:5].contiguous()
    q = torch.cat([torch.zeros(5, *query.shape[1:], dtype=dtype), query[-70:]])  # the last sequence: 5 cached + 70 new
    for pos in (0, 31, 69):
        row = _rows(q, k_cache, v_cache, table, 5 + pos, 5 + pos + 1, head_dim**-0.5)[0]
        assert torch.equal(row, native[-70 + pos]), pos


def test_results_do_not_depend_on_the_thread_count():
    """A long decode row is cut into parts (how many depends on the threads) merged by log-sum-exp."""
    batch = make_batch([4099, 5], [1, 1], 16, 3, 3, torch.float32, seed=5)
    assert max_diff(batch) <= 1e-5
    query, k_cache, v_cache, meta, new_kv = batch
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_paged_attention(query, k_cache, v_cache, meta, D**-0.5, new_kv)
    finally:
        torch.set_num_threads(threads)
    split = native_paged_attention(query, k_cache, v_cache, meta, D**-0.5, new_kv)
    assert (one - split).abs().max().item() <= 1e-5


def test_peaked_softmax_where_most_weights_underflow():
    """Scores ~N(0, 20^2): most weights fall below e^-80 and are dropped. fp32 rounding of such
    scores moves both paths ~1e-5, so the judge is the torch path in float64."""
    query, k_cache, v_cache, meta, new_kv = make_batch([0, 300, 4099], [9, 1, 1], 16, 3, 3, torch.float32, seed=2)
    query = query * 20
    native = native_paged_attention(query, k_cache, v_cache, meta, D**-0.5, new_kv)
    exact = torch_paged_attention(
        query.double(), k_cache.double(), v_cache.double(), meta, D**-0.5, (new_kv[0].double(), new_kv[1].double())
    )
    assert (native.double() - exact).abs().max().item() <= 1e-5


def _rows(query, k_cache, v_cache, table, start: int, end: int, scale: float) -> torch.Tensor:
    """Attention of the sequence's tokens start..end-1 as one chunk over keys 0..end-1."""
    q = query[start:end]
    out = torch.empty_like(q)
    torch.ops.kvpool_attn.paged_attention_out(
        out, q, k_cache, v_cache, table, torch.tensor([0, end - start]), torch.tensor([end]), torch.tensor([0]),
        scale, 0, 0.0,
    )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,kv_heads,group", [(16, 3, 3), (1, 2, 1), (32, 2, 8)])
def test_a_rows_bits_do_not_depend_on_its_chunk(dtype, block_size, kv_heads, group):
    """One prompt of 1,100 tokens (three 512-key parts) attended in one prefill, in chunks of 7
    and 64, and one token at a time (decode rows): every row's output is the same bits."""
    n, heads = 1100, kv_heads * group
    gen = torch.Generator().manual_seed(block_size)
    blocks = -(-n // block_size)
    k_cache = torch.randn(blocks + 2, block_size, kv_heads, D, generator=gen).to(dtype)
    v_cache = torch.randn(blocks + 2, block_size, kv_heads, D, generator=gen).to(dtype)
    table = torch.randperm(blocks + 2, generator=gen)[:blocks].view(1, -1).contiguous()
    query = torch.randn(n, heads, D, generator=gen).to(dtype)
    whole = _rows(query, k_cache, v_cache, table, 0, n, D**-0.5)
    for chunk in (7, 64):
        parts = [_rows(query, k_cache, v_cache, table, s, min(n, s + chunk), D**-0.5) for s in range(0, n, chunk)]
        assert torch.equal(torch.cat(parts), whole), f"chunks of {chunk}"
    for pos in (0, 1, 31, 32, 511, 512, 700, 1023, 1099):
        assert torch.equal(_rows(query, k_cache, v_cache, table, pos, pos + 1, D**-0.5)[0], whole[pos]), f"decode row {pos}"
