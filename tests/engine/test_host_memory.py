"""A long prompt's prefill reuses the memory the previous one freed instead of faulting fresh
pages in (glibc): measured as the process's minor page faults around a prefill."""

from __future__ import annotations

import resource
import sys

import pytest
import torch
from engine_helpers import make_engine, run_all

from kvpool.engine.host_memory import keep_freed_memory
from kvpool.engine.loader import load_model
from kvpool.sched.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def test_long_prefill_reuses_freed_pages():
    # bf16: its packed kernels allocate per op what float32's oneDNN path reuses
    engine = make_engine(load_model(None, dtype=torch.bfloat16), dtype="bfloat16", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    tokens = 1088  # above 512 rows: the layers' activations are megabytes per op
    faults = []
    for i in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run_all(engine, [[(7 * j + i) % 30000 + 100 for j in range(tokens)]], params)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # glibc's defaults: ~42,000 faults for each such prefill
    assert faults[1] + faults[2] < 4000, faults


def test_applied_once():
    assert keep_freed_memory() is keep_freed_memory() is True
