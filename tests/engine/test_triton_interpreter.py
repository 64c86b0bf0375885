"""The CUDA path without a GPU: triton's interpreter runs the Triton kernel on CPU tensors.

TRITON_INTERPRET=1 only takes effect if it is set before triton is first imported, so the
kernel runs in a fresh interpreter process (this file, run as a script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# (block size, window, softcap); the interpreter takes ~50 ms per program, so the default suite
# runs three cases and the slow suite the whole matrix
CASES = [(16, None, None), (32, 20, None), (64, 9, 0.8)]
ALL_CASES = [(bs, w, c) for bs in (16, 32, 64) for w, c in ((None, None), (20, None), (None, 5.0), (9, 0.8))]


def run_cases(cases: list[tuple]) -> list[float]:
    """Max abs diff, Triton kernel vs the CPU path, per case (called in the interpreter process)."""
    from attention_helpers import D, make_batch

    from kvpool.engine.attention import torch_paged_attention
    from kvpool.engine.kernels.triton_attention import make_kernel, triton_paged_attention

    kernel = make_kernel()
    diffs = []
    for block_size, window, softcap in cases:
        # a fresh prompt, a chunk over a cached prefix, decodes with short and block-crossing contexts
        batch = make_batch([0, 37, 5, 70], [5, 3, 1, 1], block_size, 2, 2, torch.float32, seed=block_size)
        query, k_cache, v_cache, meta, new_kv = batch
        got = triton_paged_attention(query, k_cache, v_cache, meta, D**-0.5, window, softcap, kernel=kernel)
        ref = torch_paged_attention(query, k_cache, v_cache, meta, D**-0.5, new_kv, window, softcap)
        diffs.append((got - ref).abs().max().item())
    return diffs


def interpreted(which: str) -> list[float]:
    pytest.importorskip("triton", reason="triton is not installed (pip install 'kvpool[test]')")
    here = Path(__file__).resolve()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[2]), str(here.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(here), which], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_kernel_equals_the_cpu_path_on_ragged_prefill_and_decode():
    diffs = interpreted("default")
    assert len(diffs) == len(CASES) and max(diffs) <= 1e-5, list(zip(CASES, diffs, strict=True))


@pytest.mark.slow
def test_triton_kernel_equals_the_cpu_path_over_every_block_size_window_and_softcap():
    diffs = interpreted("all")
    assert len(diffs) == len(ALL_CASES) and max(diffs) <= 1e-5, list(zip(ALL_CASES, diffs, strict=True))


if __name__ == "__main__":
    print(json.dumps(run_cases(ALL_CASES if sys.argv[1:] == ["all"] else CASES)))
