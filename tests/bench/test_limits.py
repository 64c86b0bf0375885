"""The workload floor of `kvpool bench throughput`: prefill at the best rate, then each decode
step bound by the slower of its matmuls and one weight read."""

from __future__ import annotations

import pytest

from kvpool.bench.limits import MachineLimits, floor_seconds, measure_dram_read_gbps


def test_floor_takes_the_best_dtype_and_the_slower_bound_of_each_decode_step():
    limits = MachineLimits({"float32": 100.0, "bfloat16": 1000.0}, dram_read_gbps=10.0)
    assert limits.best_dtype == "bfloat16"
    # prefill: 2e9 FLOP/token x 1000 tokens at 1e12 FLOP/s = 2 s; a decode step of 10 rows:
    # matmuls 2e10 / 1e12 = 0.02 s < weights 2 x 1e9 B / 1e10 B/s = 0.2 s; 4 steps after the prefill
    floor = floor_seconds(limits, 2e9, params=10**9, prompt_lens=[100] * 10, output_len=5)
    assert floor == pytest.approx(2.0 + 4 * 0.2)
    # with enough rows the decode step becomes compute-bound
    wide = floor_seconds(limits, 2e9, params=10**9, prompt_lens=[1] * 1000, output_len=2)
    assert wide == pytest.approx(2.0 + 2.0)


def test_dram_bandwidth_is_measured_positive():
    assert measure_dram_read_gbps(mib=64, seconds=0.1) > 0
