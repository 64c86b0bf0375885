"""Fast-forwarding decode instances (`ClusterConfig.fast_forward_decode`) changes nothing:
every request's timeline, every counter and the conductor's statistics equal those of the
one-event-at-a-time run, on a real trace and on a cost model whose constant step times put
many events at exactly the same instant."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpool.conductor.records import ConductorConfig
from kvpool.costs.cost_model import StepBatch
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.cluster import ClusterConfig, ClusterResult, SimCluster
from kvpool.sim.experiments.base import roofline
from kvpool.sim.traces import TraceOptions, load_mooncake_trace
from kvpool.sim.workloads import SimRequest


class ConstantCost:
    """Every step 10 ms and every transfer 5 ms: events collide on exact instants."""

    def step_time(self, batch: StepBatch) -> float:
        return 0.01

    def kv_transfer_time(self, num_blocks: int) -> float:
        return 0.005 if num_blocks > 0 else 0.0


def _run(config: ClusterConfig, cost, reqs, fast: bool) -> ClusterResult:
    return SimCluster(replace(config, fast_forward_decode=fast), cost).run(reqs)


def _outcome(res: ClusterResult) -> tuple:
    requests = [(m.request_id, m.token_times, m.finish_s, m.rejected, m.cached_tokens) for m in res.metrics]
    return (requests, res.conductor, res.instances, res.end_s, res.samples, res.rejected_after_prefill,
            res.wasted_prefill_tokens, res.prefill_tokens, res.transferred_blocks)


@pytest.mark.parametrize(("pool", "samples"), [(False, 5.0), (True, 5.0), (False, 0.0)])
def test_fast_forward_matches_stepping_on_the_conversation_trace(pool, samples):
    cost, _ = roofline("llama2-70b", "a800-80gb", tp=8, block_size=16)
    reqs = load_mooncake_trace("conversation", TraceOptions(max_requests=120, max_prompt_len=8000))
    sched = SchedulerConfig(num_blocks=3000, block_size=16, max_num_batched_tokens=8192, max_model_len=131072)
    cond = ConductorConfig(policy="kv-centric", ttft_slo_s=30.0, tbt_slo_s=0.1, block_size=16)
    config = ClusterConfig(2, 2, sched, cond, pool_blocks=6000 if pool else 0, sample_interval_s=samples)
    fast, slow = _run(config, cost, reqs, True), _run(config, cost, reqs, False)
    assert _outcome(fast) == _outcome(slow)
    assert sum(i["steps"] for i in fast.instances.values()) > 1000  # decode steps were fast-forwarded


@pytest.mark.parametrize("samples", [0.02, 0.0])  # without samples, runs end only where a decode instance is observed
def test_fast_forward_matches_stepping_when_events_tie(samples):
    reqs = [SimRequest(f"r{i}", 0.01 * (i // 3), 40 + 16 * (i % 5), 3 + 7 * (i % 4), ((i % 4, 40 + 16 * (i % 5)),),
                       (1 << 41) + i) for i in range(60)]
    sched = SchedulerConfig(num_blocks=60, block_size=16, max_num_batched_tokens=256, max_model_len=1024)
    for policy in ("kv-centric", "round-robin"):
        config = ClusterConfig(2, 3, sched, ConductorConfig(policy=policy, block_size=16), sample_interval_s=samples)
        assert _outcome(_run(config, ConstantCost(), reqs, True)) == _outcome(_run(config, ConstantCost(), reqs, False))
