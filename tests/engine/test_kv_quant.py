"""Quantized KV blocks (int8 / fp8 e4m3 with per token-and-head scales): the kernels read
exactly the dequantized values; every block movement keeps the bytes; no dtype reads another."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import D, make_batch

from kvpool.engine.attention import native_paged_attention, paged_attention, torch_paged_attention
from kvpool.engine.kernels import paged_attention_available
from kvpool.engine.kv_quant import QUANTIZED, SCALE_BYTES, dequantize, quantize

KV_DTYPES = list(QUANTIZED)
native_only = pytest.mark.skipif(not paged_attention_available(), reason="no C++ compiler for the native kernel")


def quantized_batch(kv_dtype: str, cached, new, block_size, kv_heads, group, seed):
    """A ragged fp32 batch whose whole cache is then quantized; the reference reads its dequantization."""
    query, k, v, meta, _ = make_batch(cached, new, block_size, kv_heads, group, torch.float32, seed)
    qk, qv = quantize(k, QUANTIZED[kv_dtype]), quantize(v, QUANTIZED[kv_dtype])
    return query, (qk, qv), (dequantize(qk), dequantize(qv)), meta


def test_quantize_roundtrip_error_is_bounded():
    x = torch.randn(50, 3, D, generator=torch.Generator().manual_seed(0)) * 5
    x[0, 0] = 0  # an all-zero row gets a finite scale
    for kv_dtype, rel in (("int8", 0.5 / 127), ("fp8_e4m3", 1 / 16)):
        packed = quantize(x, QUANTIZED[kv_dtype])
        assert packed.shape == (50, 3, D + SCALE_BYTES) and packed.dtype == QUANTIZED[kv_dtype]
        back = dequantize(packed)
        amax = x.abs().amax(-1, keepdim=True)
        assert torch.all((back - x).abs() <= rel * torch.maximum(amax, x.abs()) + 1e-7)
        assert torch.equal(back[0, 0], torch.zeros(D))


CASES = {
    "decodes": ([0, 1, 15, 16, 17, 63, 200, 1023, 2100], [1] * 9),
    "mixed": ([0, 37, 0, 5, 300, 0, 64, 3, 700], [23, 11, 1, 1, 1, 90, 1, 70, 130]),
}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 4), (3, 3)])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_over_quantized_blocks_equals_attention_over_dequantized(kv_dtype, block_size, kv_heads, group,
                                                                             case):
    cached, new = CASES[case]
    query, (qk, qv), (dk, dv), meta = quantized_batch(kv_dtype, cached, new, block_size, kv_heads, group,
                                                      seed=block_size + kv_heads)
    torch_q = torch_paged_attention(query, qk, qv, meta, D**-0.5)
    torch_ref = torch_paged_attention(query, dk, dv, meta, D**-0.5)
    assert (torch_q - torch_ref).abs().max().item() <= 1e-6
    if paged_attention_available():
        native_q = native_paged_attention(query, qk, qv, meta, D**-0.5)
        native_ref = native_paged_attention(query, dk, dv, meta, D**-0.5)
        assert (native_q - native_ref).abs().max().item() <= 1e-5
        assert (native_q - torch_ref).abs().max().item() <= 1e-5


@native_only
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_bf16_queries_over_quantized_blocks(kv_dtype):
    cached, new = CASES["mixed"]
    query, (qk, qv), (dk, dv), meta = quantized_batch(kv_dtype, cached, new, 16, 2, 4, seed=1)
    q16 = query.to(torch.bfloat16)
    native = native_paged_attention(q16, qk, qv, meta, D**-0.5)
    ref = torch_paged_attention(q16, dk.to(torch.bfloat16), dv.to(torch.bfloat16), meta, D**-0.5)
    assert native.dtype == torch.bfloat16
    assert (native.float() - ref.float()).abs().max().item() <= 2e-2


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_dispatch_ignores_new_kv_so_fresh_prompts_read_the_stored_values(kv_dtype):
    """A fresh prompt attends to its quantized K/V, as a later prefix hit will."""
    query, (qk, qv), (dk, dv), meta = quantized_batch(kv_dtype, [0, 0], [80, 20], 16, 2, 2, seed=4)
    full = torch.randn(100, 2, D), torch.randn(100, 2, D)  # unquantized rows: must not be used
    out = paged_attention(query, qk, qv, meta, D**-0.5, new_kv=full)
    ref = torch_paged_attention(query, dk, dv, meta, D**-0.5)
    assert (out - ref).abs().max().item() <= 1e-5
