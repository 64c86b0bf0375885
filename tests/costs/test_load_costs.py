"""The simulator's side of the planner: a cost model's store tiers and prefill as `LoadCosts`;
a scheduler given them cuts a hit on a slow tier and keeps it on a fast one."""

import dataclasses

import pytest

from kvpool.core.load_plan import plan_load
from kvpool.costs.cost_model import RooflineCostModel
from kvpool.costs.load_costs import ModelLoadCosts, tier_read_cost
from kvpool.costs.presets import HARDWARE, MODELS
from kvpool.errors import ConfigError
from kvpool.sched.config import SchedulerConfig
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler


def roofline():
    return RooflineCostModel(MODELS["llama2-7b"], HARDWARE["a100-80gb"])


def test_host_loads_and_a_slow_disk_recomputes_a_prefix():
    model = roofline()
    host = plan_load(["host"] * 256, ModelLoadCosts(model, "host").estimates(), 0, 256 * 16 + 1, 16)
    # the last few blocks ride on the weights' stream of the step that computes the new token:
    # recomputing them costs (almost) nothing, so the planner leaves them to it
    assert 200 < host.blocks < 256 and host.total_s < host.recompute_s
    model.transfers = dataclasses.replace(model.transfers, disk_bandwidth=1e8)  # a slow disk
    assert plan_load(["disk"] * 256, ModelLoadCosts(model, "disk").estimates(), 0, 256 * 16 + 1, 16).blocks == 0
    with pytest.raises(ConfigError, match="tape"):
        tier_read_cost(model.transfers, "tape")


def test_a_scheduler_cuts_the_store_hit_where_recompute_is_cheaper():
    config = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=256,
                             max_model_len=256)
    sched = Scheduler(config, external_kv=lambda hashes: len(hashes))  # the store holds everything

    class Costs:  # 2 blocks read cheaply, then each block costs more than computing it
        def tiers_of(self, hashes):
            return (["host", "host"] + ["remote"] * len(hashes))[: len(hashes)]

        def estimates(self):
            from kvpool.core.load_plan import LoadEstimates, ReadCost
            return LoadEstimates({"host": ReadCost(0.0, 1e12), "remote": ReadCost(1.0, 1e12)}, 1,
                                 lambda c, n: 0.01 * n)

    sched.admission.load_costs = Costs()
    sched.add_request(SequenceGroup("r", [sched.new_sequence(range(30))], SamplingParams(max_tokens=1), 0.0))
    out = sched.schedule()
    assert [(ld.start_block, len(ld.hashes)) for ld in out.kv_loads] == [(0, 2)]
    assert sched.admission.num_recomputed_for_speed_tokens == (7 - 2) * 4
