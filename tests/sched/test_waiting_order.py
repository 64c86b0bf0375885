"""The order waiting requests are admitted in: FCFS, cache hits first, or the least prefill work left
first, the last two within a bypass bound."""

from __future__ import annotations

import pytest

from kvpool.errors import ConfigError
from kvpool.sched.output import Sample
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig

SHARED = list(range(100, 164))  # 4 blocks of 16


def add(s: Scheduler, rid: str, prompt: list[int], arrival: float, max_tokens: int = 2) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    s.add_request(SequenceGroup(rid, [s.new_sequence(prompt)], params, arrival))


def admission_order(s: Scheduler) -> list[str]:
    """Run everything to the end; the request ids in the order they were first scheduled."""
    order: list[str] = []
    while s.has_unfinished():
        out = s.schedule()
        for x in out.scheduled:
            if x.group.request_id not in order:
                order.append(x.group.request_id)
        s.postprocess(out, [Sample([7]) for _ in out.sampling])
    return order


def scheduler(policy: str, max_bypass: int = 8) -> Scheduler:
    # one request at a time, so the waiting order is the only thing that decides who goes next
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=1, max_num_batched_tokens=256,
                                  max_model_len=256, scheduling_policy=policy, max_bypass=max_bypass))
    add(s, "warm", SHARED + [1, 2, 3], 0.0)
    admission_order(s)  # SHARED's blocks are now in the device prefix cache
    return s


def test_fcfs_admits_in_arrival_order_whatever_is_cached() -> None:
    s = scheduler("fcfs")
    add(s, "cold", list(range(500, 570)), 1.0)
    add(s, "hot", SHARED + [9, 9, 9], 2.0)
    assert admission_order(s) == ["cold", "hot"]


def test_cache_aware_admits_the_longest_cached_prefix_first() -> None:
    s = scheduler("cache-aware")
    add(s, "cold", list(range(500, 570)), 1.0)
    add(s, "half", SHARED[:32] + list(range(700, 740)), 2.0)
    add(s, "hot", SHARED + [9, 9, 9], 3.0)
    assert admission_order(s) == ["hot", "half", "cold"]
    assert s.waiting_order.num_reordered == 2


def test_shortest_prefill_admits_the_least_work_left_first() -> None:
    """Work left is the prompt less its cached prefix: a long prompt that is mostly cached goes
    before a shorter cold one, and a short cold one before a long cold one."""
    s = scheduler("shortest-prefill")
    add(s, "long", list(range(500, 700)), 1.0)  # 200 tokens to compute
    add(s, "short", list(range(800, 840)), 2.0)  # 40
    add(s, "hot", SHARED + list(range(900, 920)), 3.0)  # 84 long, 64 cached: 20
    assert admission_order(s) == ["hot", "short", "long"]
    assert s.waiting_order.num_reordered == 2


@pytest.mark.parametrize("policy", ["cache-aware", "shortest-prefill"])
def test_equal_candidates_keep_their_arrival_order(policy: str) -> None:
    s = scheduler(policy)
    for i in range(4):
        add(s, f"r{i}", list(range(1000 + 100 * i, 1040 + 100 * i)), float(i))
    assert admission_order(s) == ["r0", "r1", "r2", "r3"]
    assert s.waiting_order.num_reordered == 0


@pytest.mark.parametrize("policy", ["cache-aware", "shortest-prefill"])
def test_a_long_cold_prompt_is_passed_over_at_most_max_bypass_times(policy: str) -> None:
    s = scheduler(policy, max_bypass=3)
    add(s, "long", list(range(500, 700)), 1.0)
    for i in range(6):
        add(s, f"hot{i}", SHARED + [i, i, i], 2.0 + i)
    order = admission_order(s)
    assert order == ["hot0", "hot1", "hot2", "long", "hot3", "hot4", "hot5"], order


def test_a_request_is_passed_over_at_most_max_bypass_times() -> None:
    s = scheduler("cache-aware", max_bypass=2)
    add(s, "cold", list(range(500, 570)), 1.0)
    for i in range(5):
        add(s, f"hot{i}", SHARED + [i, i, i], 2.0 + i)
    order = admission_order(s)
    assert order.index("cold") == 2, order  # after exactly two later hits
    assert order == ["hot0", "hot1", "cold", "hot2", "hot3", "hot4"]


def test_prompt_logprobs_requests_get_no_preference() -> None:
    """Their prompt is recomputed whole (every position's logprob): a hit saves them nothing."""
    s = scheduler("cache-aware")
    add(s, "cold", list(range(500, 570)), 1.0)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    s.add_request(SequenceGroup("hot-logprobs", [s.new_sequence(SHARED + [9])], params, 2.0))
    assert admission_order(s) == ["cold", "hot-logprobs"]


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="scheduling_policy"):
        SchedulerConfig(num_blocks=8, scheduling_policy="priority")


def first_step(s: Scheduler) -> list[str]:
    """The request ids the next step schedules (then the step runs)."""
    out = s.schedule()
    s.postprocess(out, [Sample([7]) for _ in out.sampling])
    return [x.group.request_id for x in out.scheduled]


@pytest.mark.parametrize("policy,together", [("fcfs", True), ("shortest-prefill", False)])
def test_shortest_prefill_starts_a_long_prompt_a_step_after_the_short_ones(policy: str, together: bool) -> None:
    """A step costs what its tokens cost: a cache hit admitted beside a long cold prompt waits
    out that prompt's prefill for its first token. Shortest-prefill leaves the long one (over
    4x the step's admitted work and over 256 tokens) to the next step; FCFS takes both."""
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=512,
                                  max_model_len=512, scheduling_policy=policy))
    add(s, "warm", SHARED + [1, 2, 3], 0.0)
    admission_order(s)
    add(s, "long", list(range(500, 800)), 1.0)  # 300 tokens to compute
    add(s, "hot", SHARED + [9, 9, 9], 2.0)  # 3 (64 cached)
    add(s, "short", list(range(900, 940)), 3.0)  # 40: under 4x the hit's work and 256, admitted beside it
    first = first_step(s)
    assert sorted(first) == (["hot", "long", "short"] if together else ["hot", "short"]), first
    if not together:
        assert "long" in first_step(s)


def test_a_deferred_long_prompt_is_started_at_the_bypass_bound() -> None:
    """With a later hit admitted ahead of it before every step, the long prompt starts in the step
    that passes it over for the `max_bypass`-th time (3 here), not never."""
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=512,
                                  max_model_len=512, scheduling_policy="shortest-prefill", max_bypass=3))
    add(s, "warm", SHARED + [1, 2, 3], 0.0)
    admission_order(s)
    add(s, "long", list(range(500, 800)), 1.0)
    steps = []
    for i in range(4):
        add(s, f"hot{i}", SHARED + [i, i, i], 2.0 + i)
        steps.append(first_step(s))
    started = next(i for i, ids in enumerate(steps) if "long" in ids)
    assert started == 2, steps


def chunked(policy: str, max_bypass: int = 8) -> Scheduler:
    """A 256-token budget: a 600-token prompt takes three chunks."""
    s = Scheduler(SchedulerConfig(num_blocks=128, block_size=16, max_num_seqs=4, max_num_batched_tokens=256,
                                  max_model_len=1024, scheduling_policy=policy, max_bypass=max_bypass))
    add(s, "long", list(range(2000, 2600)), 0.0)
    assert first_step(s) == ["long"]  # its first chunk is computed: it is running, part-computed
    return s


@pytest.mark.parametrize("policy,alone", [("fcfs", False), ("shortest-prefill", True)])
def test_a_short_prompt_runs_before_a_long_prompts_next_chunk(policy: str, alone: bool) -> None:
    """A short prompt arriving during a long prompt's chunked prefill: FCFS gives the long one's
    next chunk the budget first (the short one waits for every chunk left, its first token
    with them); shortest-prefill runs the short one in a step of its own, then the long one
    goes on where it stood."""
    s = chunked(policy)
    add(s, "short", list(range(900, 940)), 1.0)  # 40 tokens: a step with it holds no chunk of 344 left
    step = first_step(s)
    if alone:
        assert step == ["short"], step
        assert "long" in first_step(s)  # then its next chunk
    else:
        assert step == ["long"], step  # the whole budget
    assert admission_order(s).count("long") == 1  # and it finishes either way


def test_a_part_computed_prompt_shares_the_step_with_prompts_that_are_not_much_shorter() -> None:
    """The chunk waits only for prompts under a quarter of its own work: a 200-token prompt
    beside 344 tokens left is admitted first and the long one takes what is left of the budget."""
    s = chunked("shortest-prefill")
    add(s, "medium", list(range(900, 1100)), 1.0)
    out = s.schedule()
    assert [(x.group.request_id, x.num_new_tokens) for x in out.scheduled] == [("medium", 200), ("long", 56)]


def test_a_part_computed_prompt_sits_out_at_most_max_bypass_steps() -> None:
    """With a short prompt arriving before every step, the long one's next chunk still runs in
    the step after it sat out `max_bypass` (2 here) steps."""
    s = chunked("shortest-prefill", max_bypass=2)
    steps = []
    for i in range(4):
        add(s, f"s{i}", list(range(3000 + 50 * i, 3020 + 50 * i)), 1.0 + i)
        steps.append(first_step(s))
    assert ["long" in ids for ids in steps] == [False, False, True, True], steps


@pytest.mark.parametrize("policy", ["fcfs", "shortest-prefill"])
def test_a_prompt_waits_for_the_prefix_blocks_a_running_prompt_is_computing(policy: str) -> None:
    """A prompt that shares its next uncached blocks with a prompt still being computed waits
    for them to land as a hit (cache-aware and shortest-prefill) instead of computing them
    again beside it; FCFS admits it at once and computes them twice."""
    s = Scheduler(SchedulerConfig(num_blocks=128, block_size=16, max_num_seqs=4, max_num_batched_tokens=256,
                                  max_model_len=1024, scheduling_policy=policy))
    long = list(range(2000, 2400))  # 25 blocks: chunks of 256 and 144
    add(s, "long", long, 0.0)
    assert first_step(s) == ["long"]  # blocks 0-15 computed (cached), 16-24 still to compute
    add(s, "twin", long[:384] + list(range(5000, 5040)), 1.0)  # the same first 24 blocks, then its own
    out = s.schedule()
    s.postprocess(out, [Sample([7]) for _ in out.sampling])
    twin = [x for x in out.scheduled if x.group.request_id == "twin"]
    if policy == "fcfs":
        assert [(x.start, x.num_new_tokens) for x in twin] == [(256, 112)]  # blocks 16-22 again
        return
    assert not twin  # it waits while "long" computes blocks 16-24
    out = s.schedule()
    assert [(x.group.request_id, x.start, x.num_new_tokens) for x in out.scheduled if x.group.request_id == "twin"] \
        == [("twin", 384, 40)]  # 24 blocks hit: only its own 40 tokens computed
