"""A request's greedy tokens and logprobs are the same bits whatever it is batched with, however
its prompt is chunked and wherever its prefix KV came from (docs/determinism.md), in bf16 (the
default dtype here) and float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import assert_no_leak
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import Tensor

from kvpool.bench.determinism import greedy, random_prompts, serve, serve_beside
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.kernels import batch_invariant, q4_amx_available, q4_lanes_available
from kvpool.engine.layers.linear import (
    AgreeingBuckets,
    PackedLinear,
    Q4Linear,
    Q4TileLinear,
    Q8Linear,
    Q8TileLinear,
    TileLinear,
    can_pack_weights,
    row_bucket,
)
from kvpool.engine.loader import load_model
from kvpool.engine.models.quantized import (
    lanes_groups,
    q4_groups,
    q8_groups,
    row_limits,
    tile_groups,
)

pytestmark = pytest.mark.skipif(not batch_invariant(), reason="KVPOOL_BATCH_INVARIANT=0")
needs_lanes = pytest.mark.skipif(not q4_lanes_available(), reason="no AVX512-BF16 lanes kernels on this CPU")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(scope="module", params=list(DTYPES))
def model(request):
    return request.param, load_model(None, dtype=DTYPES[request.param])


def _engine(loaded, dtype: str, **kw) -> Engine:
    return Engine(EngineConfig(**{"dtype": dtype, "num_blocks": 1024, "block_size": 16, **kw}), loaded=loaded)


def _exact_weight(n: int, k: int, bits: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    groups = k // 32
    if bits == 4:
        q = torch.randint(0, 16, (n, groups, 32), generator=gen).float()
        q[:, :, 0], q[:, :, 1] = 0, 15
        d = (torch.rand(n, groups, 1, generator=gen) * 0.05).half().float()
        m = (-torch.rand(n, groups, 1, generator=gen) * 0.3).half().float()
        return (q * d + m).reshape(n, k)
    q = torch.randint(-127, 128, (n, groups, 32), generator=gen).float()
    q[:, :, 0] = 127
    d = (torch.rand(n, groups, 1, generator=gen) * 0.01).half().float()
    return (q * d).reshape(n, k)


@needs_lanes
@pytest.mark.skipif(not can_pack_weights("cpu", torch.bfloat16), reason="oneDNN has no bf16 GEMM here")
@pytest.mark.parametrize("bits", [4, 8])
# (48, 96): three strips of 16 outputs, the last paired with itself
@pytest.mark.parametrize("shape", [(960, 288), (576, 768), (3072, 288), (64, 1536), (48, 96)])
def test_grouped_kernels_give_the_dense_gemms_bits_at_every_row_count(bits, shape):
    """4-bit / 8-bit rows and the dense oneDNN GEMM are interchangeable: the same bits, with
    the kernel the packer picks on this CPU (the lanes kernels, or the AMX tile kernel)."""
    w = _exact_weight(*shape, bits, seed=shape[0])
    groups = q4_groups(w) if bits == 4 else q8_groups(w)
    dense = PackedLinear(w.bfloat16(), None)
    vector_rows, max_rows = row_limits(True, invariant=True)
    served = tile_groups(dense, groups) if vector_rows == 0 else lanes_groups(dense, groups)
    assert served is not None
    if vector_rows == 0:  # AMX: the groups repacked in the B tiles' order
        lin = (Q4TileLinear(served, None) if bits == 4
               else Q8TileLinear(dense, served, None, max_rows))
    else:
        lin = (Q4Linear if bits == 4 else Q8Linear)(dense, served, None, max_rows, vector_rows)
    x = torch.randn(600, shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    want = torch.cat([dense(row) for row in x.split(1)])
    for rows in (1, 2, 3, 5, 8, 9, 16, 32, 33, 48, 70, 129, 256, 257, 512, 513, 600):
        assert torch.equal(lin(x[:rows]), want[:rows]), rows


@needs_lanes
@pytest.mark.skipif(not can_pack_weights("cpu", torch.bfloat16), reason="oneDNN has no bf16 GEMM here")
@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_the_lanes_kernels_k_block_is_onednns_on_the_bundled_models_shapes(dtype):
    """Where two K blocks differ on ~1 output in 10^5 (all of K and 512 on K = 576), the packer
    still finds oneDNN's: a decode row's bits are its prefill row's on 1,000 rows x N outputs
    (a 48-row probe let the wrong block through on an AVX512-BF16 CPU without AMX)."""
    if dtype == torch.float32 and not q4_lanes_available(True):
        pytest.skip("no float32 lanes kernels here")
    gen = torch.Generator().manual_seed(5)
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        w = _exact_weight(n, k, 4, seed=n + k)
        dense = PackedLinear(w.to(dtype), None)
        served = lanes_groups(dense, q4_groups(w), dtype)
        assert served is not None, (n, k)
        x = (torch.randn(1000, k, generator=gen) * 0.05).to(dtype)
        assert torch.equal(torch.ops.kvpool.q4_linear(x, *served), dense(x)), (n, k)


@pytest.mark.skipif(not can_pack_weights("cpu", torch.float32), reason="no oneDNN")
@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_dense_gemm_rows_do_not_depend_on_the_row_count(dtype):
    """oneDNN's packed GEMM, on the bundled model's shapes: a row's bits are the same alone or
    in any row bucket (what the invariant path relies on; checked, not assumed)."""
    if dtype == torch.bfloat16 and not can_pack_weights("cpu", dtype):
        pytest.skip("oneDNN has no bf16 GEMM here")
    gen = torch.Generator().manual_seed(0)
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        lin = PackedLinear(torch.randn(n, k, generator=gen).to(dtype), None)
        x = torch.randn(600, k, generator=gen).to(dtype)
        alone = torch.cat([lin(x[i : i + 1]) for i in range(0, 600, 37)])
        for rows in sorted({row_bucket(m) for m in range(1, 601)}):
            got = lin(x[:rows])[: rows : 37]
            assert torch.equal(got, alone[: got.shape[0]]), (n, k, rows)


@pytest.mark.skipif(not q4_amx_available(), reason="no AMX tile kernel on this CPU")
@pytest.mark.parametrize("shape", [(960, 576), (100, 64)])
def test_the_tile_kernel_gives_each_row_its_solo_bits_at_any_row_count(shape):
    """TileLinear (AMX, dense bf16 weights packed once) at 1-600 rows, across its few-row and
    many-row forms and its 256-row chunks, equals oneDNN's GEMM on each row alone."""
    gen = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=gen).bfloat16()
    tiles, dense = TileLinear(w, None), PackedLinear(w, None)
    x = torch.randn(600, shape[1], generator=gen).bfloat16()
    alone = torch.cat([dense(row) for row in x.split(1)])
    for rows in (1, 3, 16, 32, 33, 100, 256, 257, 600):
        assert torch.equal(tiles(x[:rows]), alone[:rows]), rows


def test_a_bucket_summing_in_another_order_runs_as_chunks_of_one_that_agrees():
    """`AgreeingBuckets` on a GEMM that, like oneDNN's bf16 one on AMX, sums K in blocks for
    some row buckets: those buckets are found on probe rows and run as chunks of an agreeing
    bucket below them or padded to one above, whichever costs less, so each row gets its solo
    bits."""
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(3))

    def chain(x: Tensor, lo: int, hi: int) -> Tensor:  # float32 sums over K in order
        acc = torch.zeros(x.shape[0], w.shape[0])
        for k in range(lo, hi):
            acc = acc + x[:, k, None].float() * w[:, k]
        return acc

    def gemm(x: Tensor) -> Tensor:
        if 40 <= x.shape[0] < 128:  # two K blocks summed apart, then added
            return (chain(x, 0, 32) + chain(x, 32, 64)).bfloat16()
        return chain(x, 0, 64).bfloat16()

    buckets = AgreeingBuckets(gemm, w.shape, torch.bfloat16)
    assert [b for b in (8, 16, 32, 40, 64, 96, 128, 144) if buckets.agrees(b)] == [8, 16, 32, 128, 144]
    assert buckets.chunk_rows(64) == 32 and buckets.chunk_rows(96) == 128  # 3 calls of 32 cost more than one of 128
    assert buckets.chunk_rows(144) == 144 and buckets.chunk_rows(16) == 16


@settings(max_examples=3, deadline=None, phases=[Phase.explicit, Phase.generate],  # no shrinking: minutes a step
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(others=st.integers(0, 48), chunk=st.sampled_from([16, 48, 96, 2048]), max_seqs=st.integers(1, 64),
       seed=st.integers(0, 2**16), joins_after=st.integers(0, 3))
def test_greedy_tokens_and_logprobs_do_not_depend_on_the_batch(model, others, chunk, max_seqs, seed, joins_after):
    dtype, loaded = model
    rng = np.random.default_rng(seed)
    vocab = loaded.config.vocab_size
    target = random_prompts(rng, vocab, 1, 20, 120)[0]
    params = greedy(4)
    solo = serve(_engine(loaded, dtype), [target], params)[0]
    engine = _engine(loaded, dtype, max_num_batched_tokens=chunk, max_num_seqs=max_seqs)
    got = serve_beside(engine, target, random_prompts(rng, vocab, others, 1, 160), params, others_first=joins_after)
    assert got == solo
    assert_no_leak(engine)


def test_prefix_hit_recompute_and_swap_give_the_cold_runs_bits(model):
    dtype, loaded = model
    rng = np.random.default_rng(7)
    vocab = loaded.config.vocab_size
    targets = random_prompts(rng, vocab, 2, 14, 22)
    params = greedy(16)
    cold = [serve(_engine(loaded, dtype, block_size=4), [t], params)[0] for t in targets]
    warm = _engine(loaded, dtype, block_size=4, max_num_batched_tokens=8)
    for t in targets:  # another request computes all but the last few prompt tokens, in other steps
        serve(warm, [t[:-5] + [1, 2, 3]], params)
    assert [serve(warm, [t], params)[0] for t in targets] == cold
    assert_no_leak(warm)
    crowd = random_prompts(rng, vocab, 4, 8, 16)
    for mode in ("recompute", "swap"):
        engine = _engine(loaded, dtype, block_size=4, num_blocks=16, preemption_mode=mode, swap_space="16MiB")
        got = serve(engine, targets + crowd, params)[: len(targets)]
        assert engine.scheduler.num_preemptions >= 1
        assert got == cold, mode
        assert_no_leak(engine)
