"""CUDA equivalence: the Triton kernel on a GPU against the CPU path (the engine: test_cuda_engine.py).

Skipped without CUDA; scripts/gpu_check.sh sets KVPOOL_REQUIRE_CUDA=1 so that a GPU machine
whose torch cannot see the GPU fails here instead of skipping."""

from __future__ import annotations

import os

import pytest
import torch
from attention_helpers import D, make_batch

from kvpool.engine.attention import paged_attention, torch_paged_attention

if os.environ.get("KVPOOL_REQUIRE_CUDA") == "1":
    assert torch.cuda.is_available(), "KVPOOL_REQUIRE_CUDA=1 but torch sees no CUDA device"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("window,softcap", [(None, None), (33, None), (None, 5.0), (100, 0.7)])
def test_triton_kernel_on_cuda_equals_the_cpu_path(dtype, tol, block_size, window, softcap):
    from kvpool.engine.kernels.triton_attention import triton_usable

    cached = [0, 37, 0, 600, 4099, 64, 3]
    new = [23, 11, 100, 1, 1, 70, 1]
    query, k_cache, v_cache, meta, new_kv = make_batch(cached, new, block_size, 3, 3, dtype, seed=block_size)
    ref = torch_paged_attention(query, k_cache, v_cache, meta, D**-0.5, new_kv, window, softcap)
    cuda_meta = type(meta).build(
        [e - s for s, e in zip(meta.query_start_loc[:-1].tolist(), meta.query_start_loc[1:].tolist(), strict=True)],
        meta.seq_lens.tolist(),
        meta.block_tables.tolist(),
        block_size,
        device="cuda",
    )
    k_gpu, v_gpu = k_cache.cuda(), v_cache.cuda()
    assert triton_usable(k_gpu, block_size), "triton is not importable or the shape is unsupported"
    got = paged_attention(query.cuda(), k_gpu, v_gpu, cuda_meta, D**-0.5, window=window, softcap=softcap)
    assert (got.cpu().float() - ref.float()).abs().max().item() <= tol

