"""The engine on CUDA against the CPU engine, on tiny random checkpoints of every supported
architecture (nothing downloaded, no bundled model needed): greedy tokens equal in float32
through chunked prefill, prefix hits and preemption; and on CUDA itself, a request's tokens and
logprobs the same bits solo and batched beside others, in bf16 and float32.

Skipped without CUDA; scripts/gpu_check.sh sets KVPOOL_REQUIRE_CUDA=1 so that a GPU machine
whose torch cannot see the GPU fails here instead of skipping."""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import assert_no_leak, run_all
from test_architectures import ARCHS, NEW_TOKENS, PROMPTS, hf_model

from kvpool.bench.determinism import serve_beside
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.loader import load_model
from kvpool.sched.sampling_params import SamplingParams

if os.environ.get("KVPOOL_REQUIRE_CUDA") == "1":
    assert torch.cuda.is_available(), "KVPOOL_REQUIRE_CUDA=1 but torch sees no CUDA device"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    from test_architectures import _tokenizer_json

    path = tmp_path_factory.mktemp(request.param)
    hf_model(request.param).save_pretrained(path)
    _tokenizer_json(path)
    return request.param, path


def _engine(path, device: str, dtype: str, **kw) -> Engine:
    loaded = load_model(path, dtype=getattr(torch, dtype), device=device)
    return Engine(EngineConfig(model=str(path), device=device, dtype=dtype, block_size=16, **kw), loaded=loaded)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_cuda_greedy_equals_cpu_in_fp32_through_chunks_hits_and_preemption(checkpoint, mode):
    name, path = checkpoint
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    kw = dict(num_blocks=12, max_num_batched_tokens=16, preemption_mode=mode, swap_space="16MiB", swa_freeing=False)
    outs = {}
    for device in ("cpu", "cuda"):
        engine = _engine(path, device, "float32", **kw)
        first = [o.outputs[0].token_ids for o in run_all(engine, PROMPTS, params)]
        again = [o.outputs[0].token_ids for o in run_all(engine, PROMPTS, params)]  # prefix hits
        assert again == first, (name, device)
        assert_no_leak(engine)
        outs[device] = first
    assert outs["cuda"] == outs["cpu"], name


# float32 on CUDA: cuBLAS picks its kernel (gemv, split-K) by row count, so logprobs differ in
# the last bits batched vs solo (tokens agreed on the H200, 2026-12-04); bf16, the CUDA
# default, held. strict: the day a batch-invariant fp32 matmul lands, this xfail fails.
FP32_CUBLAS = pytest.mark.xfail(strict=True, reason="fp32 matmuls on CUDA are not batch-invariant yet")


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=FP32_CUBLAS)])
def test_cuda_request_is_the_same_bits_solo_and_batched(checkpoint, dtype):
    """Batch invariance on the GPU: the target's tokens and logprobs beside 0..20 others."""
    name, path = checkpoint
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, logprobs=0)
    engine = _engine(path, "cuda", dtype, num_blocks=256)
    target = PROMPTS[0]

    solo = serve_beside(engine, target, [], params)
    gen = torch.Generator().manual_seed(0)
    for count in (1, 5, 20):
        others = [torch.randint(3, 120, (int(n),), generator=gen).tolist()
                  for n in torch.randint(2, 60, (count,), generator=gen)]
        assert serve_beside(engine, target, others, params, others_first=count % 3) == solo, (name, dtype, count)
