"""Contiguous-baseline replay: breakdown sums to one and Oracle wastes least."""

import pytest

from kvpool.core.contiguous import MaxPolicy, OraclePolicy, Pow2Policy
from kvpool.errors import ConfigError
from kvpool.sim.waste import replay_contiguous
from kvpool.sim.workloads import WorkloadSpec, synthetic_workload


def test_oracle_batches_more_and_wastes_less_than_max():
    reqs = synthetic_workload(WorkloadSpec(num_requests=200, seed=2))
    reports = {p.name: replay_contiguous(reqs, 16384, p, max_tokens=1024)
               for p in (MaxPolicy(2048), Pow2Policy(), OraclePolicy())}
    for r in reports.values():
        assert sum(r.fractions.values()) == pytest.approx(1.0)
    mx, p2, orc = reports["max"], reports["pow2"], reports["oracle"]
    assert orc.mean_batch > p2.mean_batch >= mx.mean_batch
    assert orc.fractions["token_slots"] > mx.fractions["token_slots"]
    assert mx.fractions["internal_frag_slots"] > orc.fractions["internal_frag_slots"]
    assert mx.steps > orc.steps


def test_request_larger_than_arena_is_reported():
    reqs = synthetic_workload(WorkloadSpec(num_requests=5, seed=0))
    with pytest.raises(ConfigError, match="never fit"):
        replay_contiguous(reqs, 1024, MaxPolicy(2048))
