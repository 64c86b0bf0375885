"""The single-instance driver runs the real scheduler and charges exactly the cost model."""

import pytest

from kvpool.core.kv_manager import KVCacheManager
from kvpool.costs.cost_model import (
    FEATURES,
    FittedStepModel,
    MeasuredCostModel,
    StepBatch,
    TransferCosts,
)
from kvpool.errors import ConfigError
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.instance import SimInstance, run_instance
from kvpool.sim.sim_store import SimStore
from kvpool.sim.tokens import BlockHasher, TokenSynth
from kvpool.sim.workloads import SimRequest, WorkloadSpec, synthetic_workload


class TokenCost:
    """1 ms per step plus 1 ms per new token: easy to compute by hand."""

    def step_time(self, batch: StepBatch) -> float:
        return 1e-3 + 1e-3 * sum(batch.new_tokens)

    def kv_transfer_time(self, num_blocks: int) -> float:
        return 0.0


def _req(rid: str, arrival: float, prompt: int, output: int, chunk: int) -> SimRequest:
    return SimRequest(rid, arrival, prompt, output, ((chunk, prompt),), 1 << 41)


def test_two_requests_match_a_hand_computed_timeline():
    # r0: prompt 4, 3 outputs, at t=0. r1: prompt 2, 2 outputs, at t=0.
    # step 1: prefill both (6 tokens) -> 7 ms, both emit token 1 at 0.007
    # step 2: decode both (2 tokens) -> 3 ms, token 2 at 0.010; r1 finishes
    # step 3: decode r0 (1 token) -> 2 ms, token 3 at 0.012; r0 finishes
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    run = run_instance([_req("r0", 0.0, 4, 3, 1), _req("r1", 0.0, 2, 2, 2)], cfg, TokenCost())
    by_id = {m.request_id: m for m in run.metrics}
    assert by_id["r0"].token_times == pytest.approx([0.007, 0.010, 0.012])
    assert by_id["r1"].token_times == pytest.approx([0.007, 0.010])
    assert by_id["r1"].finish_s == pytest.approx(0.010)
    assert run.end_s == pytest.approx(0.012)
    assert run.instance.counters.steps == 3


def test_idle_instance_jumps_to_the_next_arrival():
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    run = run_instance([_req("r0", 5.0, 2, 1, 1)], cfg, TokenCost())
    assert run.metrics[0].token_times == pytest.approx([5.003])


def test_a_step_after_a_pause_pays_the_measured_wake_up():
    """A measured CPU engine's first step after idling is slower; the simulator charges it to a
    request arriving at an idle instance, and not to the steps that follow back to back."""
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("intercept")], coef[FEATURES.index("wake")] = 0.01, 0.1
    cost = MeasuredCostModel(FittedStepModel(tuple(coef)), TransferCosts(1, 1, 0, 1, 0, 1, 0, 0))
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    # r1 arrives while r0 decodes (no pause); r2 long after both are done
    run = run_instance([_req("r0", 0.0, 2, 3, 1), _req("r1", 0.115, 2, 2, 2), _req("r2", 5.0, 2, 2, 3)], cfg, cost)
    by_id = {m.request_id: m for m in run.metrics}
    assert by_id["r0"].token_times == pytest.approx([0.11, 0.12, 0.13])
    assert by_id["r1"].token_times == pytest.approx([0.13, 0.14])  # joined at the 0.12 step boundary
    assert by_id["r2"].token_times == pytest.approx([5.11, 5.12])


def test_shared_prefix_is_served_from_the_prefix_cache():
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    reqs = [SimRequest(f"r{i}", float(i), 10, 2, ((7, 8), (100 + i, 2)), (1 << 41) + i) for i in range(3)]
    run = run_instance(reqs, cfg, TokenCost())
    assert [m.cached_tokens for m in run.metrics] == [0, 8, 8]


def test_parallel_sampling_shares_the_prompt_and_copies_on_write():
    cfg = SchedulerConfig(num_blocks=2000, block_size=16, max_num_batched_tokens=8192, max_model_len=2048)
    reqs = synthetic_workload(WorkloadSpec(num_requests=20, rate=float("inf"), n=4, seed=1))
    run = run_instance(reqs, cfg, TokenCost())
    assert all(m.done for m in run.metrics)
    assert run.instance.sched.kv.num_cow_copies > 0
    assert run.instance.counters.generated_tokens == sum(4 * r.output_len for r in reqs)


class LoadCost(TokenCost):
    """TokenCost, plus 1 ms per block loaded from the host tier (a step of loads only costs them)."""

    def step_time(self, batch: StepBatch) -> float:
        compute = super().step_time(batch) if batch.new_tokens else 0.0
        return compute + 1e-3 * batch.blocks_from_host


@pytest.mark.parametrize("tier_holds", [0, 1, 2])
def test_store_hits_load_through_the_schedulers_kv_load_path(tier_holds):
    """A simulated instance takes store hits as the engine does: the scheduler plans `KVLoad`s for
    the blocks past the device hit that the tier holds, the group waits one step for them (which
    costs the load), then computes only the rest of its prompt."""
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    store = SimStore(KVCacheManager(16, 4), plan=False)  # every hit loads
    inst = SimInstance("i0", cfg, LoadCost(), store=store)
    req = _req("r0", 0.0, 10, 2, 7)  # 2 full prompt blocks, 2 tokens in the partial third
    hashes = inst.hashes_for(req)
    assert len(hashes) == 2
    assert store.put(hashes[:tier_holds]) == tier_holds
    m = inst.add(req, 0.0)
    now = 0.0
    durations = []
    while inst.has_work():
        res = inst.step(now)
        durations.append(res.duration)
        now += res.duration
    loaded = 4 * tier_holds
    first = [tier_holds * 1e-3] if tier_holds else []  # the load step: nothing computes in it
    assert durations == pytest.approx(first + [1e-3 + 1e-3 * (10 - loaded), 2e-3])
    assert inst.counters.loaded_blocks == tier_holds
    assert inst.sched.num_external_hit_tokens == loaded
    assert m.cached_tokens == loaded
    assert inst.counters.prefill_tokens == 10 - loaded


def test_a_store_tier_must_be_known_and_planning_needs_transfer_costs():
    with pytest.raises(ConfigError, match="tier"):
        SimStore(KVCacheManager(4, 4), tier="tape")
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    with pytest.raises(ConfigError, match="LoadCost has none"):
        SimInstance("i0", cfg, LoadCost(), store=SimStore(KVCacheManager(16, 4)))



class LayerCost(TokenCost):
    """TokenCost plus 1 ms per block read from any tier, and the transfer costs the planner reads
    (the same 1 ms: 4 KiB blocks at 4 MB/s, no latency)."""

    transfers = TransferCosts(4096, 4096 / 1e-3, 0.0, 4096 / 1e-3, 0.0, 4096 / 1e-3, 0.0, 0.0)

    def step_time(self, batch: StepBatch) -> float:
        compute = super().step_time(batch) if batch.new_tokens else 0.0
        return compute + 1e-3 * (batch.blocks_from_host + batch.blocks_from_disk + batch.blocks_from_remote)


@pytest.mark.parametrize(("tier", "layerwise", "first"), [
    ("disk", True, [0.0, 3e-3]),  # headers only (free), then the reads (2 ms) under the 3 ms forward
    ("disk", False, [2e-3, 3e-3]),  # the reads, then the step that computes
    ("remote", True, [2e-3, 3e-3]),  # a remote pool is read whole even layer-wise, as in the engine
])
def test_layerwise_store_reads_run_under_the_next_forward_and_are_planned_overlapped(tier, layerwise, first):
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    req = _req("r0", 0.0, 10, 2, 7)  # 2 full blocks in the store; 4 ms to compute them, 2 ms to read
    hasher = BlockHasher(4, TokenSynth())
    store = SimStore(KVCacheManager(16, 4), tier, layerwise=layerwise)
    assert store.put(hasher.hashes(req.chunks)) == 2
    durations = []
    run = run_instance([req], cfg, LayerCost(), on_step=lambda inst, now, res: durations.append(res.duration),
                       hasher=hasher, store=store)
    inst = run.instance
    assert inst.reads.layerwise == (layerwise and tier == "disk")
    assert inst.sched.admission.load_costs.estimates().overlap is inst.reads.layerwise
    assert durations == pytest.approx(first + [2e-3])  # the planner loads both blocks
    assert inst.counters.loaded_blocks == 2 and run.metrics[0].cached_tokens == 8
