"""The pure plan of layer-wise loading: only blocks that were read and checked are written, in
layer order, and the overlap timeline is the max-based formula."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import ConfigError
from kvpool.sched.layerwise import overlap_timeline, plan_layerwise, whole_block_time
from kvpool.sched.output import KVLoad
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig


def load(load_id: int, block_ids: list[int]) -> KVLoad:
    return KVLoad(load_id, None, None, 0, [bytes([i]) for i in range(len(block_ids))], block_ids)  # type: ignore[arg-type]


def test_blocks_after_a_loads_first_failure_are_left_out():
    plan = plan_layerwise([load(0, [7, 8, 9]), load(1, [3, 4])], [1, 2], num_layers=4)
    assert plan.block_ids == [7, 3, 4]
    assert [(w.load, w.index) for w in plan.writes] == [(0, 0), (1, 0), (1, 1)]
    assert list(plan.layers()) == [0, 1, 2, 3]
    assert list(plan_layerwise([load(0, [7])], [0], 4).layers()) == []  # nothing landed: nothing to wait for


def test_a_bad_landed_count_is_refused():
    with pytest.raises(ConfigError, match="landed 3 blocks of 2"):
        plan_layerwise([load(5, [1, 2])], [3], 2)


def test_the_plan_comes_from_the_schedulers_own_loads():
    """The scheduler plans a load of the store's blocks; a partial landing is reported before the
    plan is made, so the step computes exactly the tokens the plan does not cover."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=256))
    sched.external_kv = lambda hashes: len(hashes)  # the store holds every block
    seq = sched.new_sequence(list(range(40)))
    sched.add_request(SequenceGroup("r", [seq], SamplingParams(max_tokens=1), 0.0))
    out = sched.schedule()
    (kv_load,) = out.kv_loads
    assert len(kv_load.block_ids) == 9
    sched.finish_kv_load(kv_load, 5)  # block 5 failed its check
    plan = plan_layerwise([kv_load], [5], num_layers=3)
    assert plan.block_ids == kv_load.block_ids[:5]
    step = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in step.scheduled] == [(20, 20)]


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=40))
def test_overlap_timeline_is_the_max_recurrence_and_never_loses(layers):
    transfer, compute = [t for t, _ in layers], [c for _, c in layers]
    tl = overlap_timeline(transfer, compute)
    end = link = 0.0
    for i, (t, c) in enumerate(layers):
        link += t
        assert tl.loaded[i] == link
        assert tl.compute_start[i] == max(end, link)
        end = tl.compute_start[i] + c
        assert tl.compute_end[i] == end
    whole = whole_block_time(transfer, compute)
    assert tl.total_s <= whole + 1e-9
    assert tl.total_s >= max(sum(transfer), sum(compute)) - 1e-9


def test_equal_layers_overlap_to_one_layer_more_than_the_longer_side():
    tl = overlap_timeline([2.0] * 10, [3.0] * 10)
    assert tl.total_s == 2.0 + 30.0  # the first layer's load, then compute back to back
    tl = overlap_timeline([3.0] * 10, [2.0] * 10)
    assert tl.total_s == 30.0 + 2.0  # transfer-bound: the last layer's compute after its load
