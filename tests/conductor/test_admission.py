"""SLO admission, decode selection, early vs predictive rejection, and driver bookkeeping."""

import copy
from dataclasses import replace

import pytest
from conductor_helpers import BLOCK, CHAIN, make_predictor, make_request
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.conductor import Conductor, ConductorConfig, InstanceLoad
from kvpool.conductor.decode_view import DecodeView
from kvpool.errors import UnknownSequence

# With the fixture's predictor a decode step of b sequences takes 0.01 + 0.01 b seconds,
# so a TBT SLO of 55 ms admits at most 4 running requests per decode instance.
TBT_SLO = 0.055


def conductor(predictor, prefill=("p0",), decode=("d0",), **cfg):
    cfg.setdefault("policy", "kv-centric")
    return Conductor(list(prefill), list(decode), predictor, ConductorConfig(block_size=BLOCK, **cfg))


def test_request_no_instance_can_prefill_in_time_is_rejected_at_arrival(predictor):
    c = conductor(predictor, prefill=("p0", "p1"), ttft_slo_s=0.1)
    d = c.route(make_request("r", blocks=20), 0.0)  # 321 tokens at 1 ms each
    assert (d.accepted, d.reason) == (False, "ttft_slo")
    assert d.predicted_ttft == pytest.approx(0.321)
    assert c.stats.rejected_at_arrival == {"ttft_slo": 1}


def test_a_cached_prefix_makes_a_slow_prompt_admissible(predictor):
    c = conductor(predictor, prefill=("p0", "p1"), ttft_slo_s=0.1)
    c.index.on_stored("p1", CHAIN[:20])
    d = c.route(make_request("r", blocks=20), 0.0)
    assert (d.accepted, d.prefill_id) == (True, "p1")


def test_decode_goes_to_the_instance_with_most_headroom(predictor):
    c = conductor(predictor, decode=("d0", "d1", "d2"), tbt_slo_s=TBT_SLO, rejection="early")
    c.update_load("d0", InstanceLoad(running_decode_reqs=2))
    c.update_load("d1", InstanceLoad(running_decode_reqs=1))
    c.update_load("d2", InstanceLoad(running_decode_reqs=3))
    assert c.route(make_request("r"), 0.0).decode_id == "d1"


def _fill_decode_with_short_requests(c: Conductor, n: int) -> None:
    for i in range(n):
        assert c.route(make_request(f"s{i}", blocks=1, extra=0, max_tokens=10), 0.0).accepted
        c.on_prefill_done(f"s{i}", 0.1)  # each decodes for at most 10 x 50 ms


@pytest.mark.parametrize("rejection", ["early", "predictive"])
def test_decode_at_capacity_rejects_the_next_quick_request(predictor, rejection):
    c = conductor(predictor, tbt_slo_s=TBT_SLO, rejection=rejection)
    _fill_decode_with_short_requests(c, 4)
    d = c.route(make_request("late", blocks=1, extra=0), 0.2)
    assert (d.accepted, d.reason) == (False, "decode_overloaded")


def test_predictive_admits_what_early_rejects_when_running_requests_finish_first(predictor):
    decisions = {}
    for rejection in ("early", "predictive"):
        c = conductor(predictor, tbt_slo_s=TBT_SLO, rejection=rejection)
        _fill_decode_with_short_requests(c, 4)
        c.update_load("p0", InstanceLoad(queued_prefill_tokens=5000))  # prefill done at ~5 s
        decisions[rejection] = c.route(make_request("long"), 0.2)
    assert (decisions["early"].accepted, decisions["early"].reason) == (False, "decode_overloaded")
    assert decisions["predictive"].accepted
    assert decisions["predictive"].predicted_ttft > 5.0


def test_predictive_counts_requests_still_in_prefill_that_reach_decode_first(predictor):
    c = conductor(predictor, tbt_slo_s=TBT_SLO, rejection="predictive")
    for i in range(4):
        assert c.route(make_request(f"q{i}", max_tokens=1000), 0.0).accepted
    assert c.decode_load("d0", 0.0) == 0  # none decoding yet...
    d = c.route(make_request("next", max_tokens=1000), 0.0)  # ...but all will be when it is
    assert (d.accepted, d.reason) == (False, "decode_overloaded")


def test_predictive_assumes_untracked_running_requests_keep_running(predictor):
    c = conductor(predictor, tbt_slo_s=TBT_SLO, rejection="predictive")
    c.update_load("d0", InstanceLoad(running_decode_reqs=4))
    c.update_load("p0", InstanceLoad(queued_prefill_tokens=5000))
    assert not c.route(make_request("r"), 0.0).accepted


def test_no_rejection_accepts_past_decode_capacity(predictor):
    c = conductor(predictor, tbt_slo_s=TBT_SLO, rejection="none")
    _fill_decode_with_short_requests(c, 4)
    assert c.route(make_request("late"), 0.2).accepted


def test_decode_kv_capacity_limits_admission(predictor):
    c = conductor(predictor, rejection="early")
    c.update_load("d0", InstanceLoad(free_kv_blocks=30, total_kv_blocks=30))
    assert c.route(make_request("a", max_tokens=10), 0.0).accepted  # 21 blocks
    d = c.route(make_request("b", max_tokens=10), 0.0)  # 42 > 30
    assert (d.accepted, d.reason) == (False, "decode_overloaded")


def test_colocated_instances_decode_what_they_prefill(predictor):
    c = conductor(predictor, prefill=("a", "b"), decode=())
    c.index.on_stored("b", CHAIN[:20])
    d = c.route(make_request("r"), 0.0)
    assert (d.prefill_id, d.decode_id) == ("b", "b")


def test_rejected_after_prefill_counts_wasted_work_and_frees_the_slot(predictor):
    c = conductor(predictor, tbt_slo_s=TBT_SLO, rejection="early")
    c.route(make_request("r"), 0.0)
    c.on_prefill_done("r", 0.4)
    c.on_rejected_after_prefill("r", wasted_tokens=321)
    assert (c.stats.rejected_after_prefill, c.stats.wasted_prefill_tokens) == (1, 321)
    assert c.decode_load("d0", 0.5) == 0
    with pytest.raises(UnknownSequence):
        c.on_decode_done("r", 1.0)


def test_completion_counts_slo_met_only_within_both_slos(predictor):
    c = conductor(predictor, ttft_slo_s=1.0, tbt_slo_s=0.1)
    for rid in ("fast", "slow_first", "slow_tbt"):
        c.route(make_request(rid, blocks=1, max_tokens=11), 0.0)
    c.on_prefill_done("fast", 0.5)
    c.on_decode_done("fast", 1.5, output_tokens=11)  # 100 ms per token
    c.on_prefill_done("slow_first", 1.5)
    c.on_decode_done("slow_first", 2.0, output_tokens=11)
    c.on_prefill_done("slow_tbt", 0.5)
    c.on_decode_done("slow_tbt", 2.0, output_tokens=11)  # 150 ms per token
    assert (c.stats.completed, c.stats.slo_met) == (3, 1)


ops = st.lists(
    st.tuples(st.sampled_from(["route", "prefill", "done", "waste", "report"]), st.integers(0, 30)),
    max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(ops, st.sampled_from(["none", "early", "predictive"]))
def test_bookkeeping_returns_to_idle_after_every_request_ends(history, rejection):
    c = conductor(
        make_predictor(), prefill=("p0", "p1"), decode=("d0", "d1"), tbt_slo_s=0.2, rejection=rejection
    )
    live: dict[str, bool] = {}  # request id -> prefill done
    now = 0.0
    for step, (op, n) in enumerate(history):
        now += 0.01 * n
        if op == "route":
            if c.route(make_request(f"r{step}", blocks=n % 5, max_tokens=n + 1), now).accepted:
                live[f"r{step}"] = False
        elif op == "report":
            c.update_load(f"p{n % 2}", InstanceLoad(queued_prefill_tokens=n))
        elif live:
            rid = sorted(live)[n % len(live)]
            if op == "prefill":
                c.on_prefill_done(rid, now)
                live[rid] = True
            elif op == "done":
                c.on_decode_done(rid, now)
                del live[rid]
            else:
                c.on_rejected_after_prefill(rid, wasted_tokens=n)
                del live[rid]
    for p in ("p0", "p1"):
        c.update_load(p, InstanceLoad())
    for rid in list(live):
        c.on_decode_done(rid, now)
    assert c.snapshot()["in_flight"] == 0
    for inst in ("p0", "p1", "d0", "d1"):
        assert c.queued_prefill_tokens(inst) == 0
        assert c.decode_load(inst, now) == 0
        assert c.decode_load(inst, 0.0) == 0


def test_a_failed_request_leaves_the_books_without_counting_as_wasted_prefill():
    c = Conductor(["p0"], ["d0"], make_predictor(), ConductorConfig(policy="round-robin"))
    c.update_load("d0", InstanceLoad(free_kv_blocks=1000, total_kv_blocks=1000))
    assert c.route(make_request("r1"), now=0.0).accepted
    c.on_failed("r1")
    assert c.stats.failed == 1
    assert c.stats.rejected_after_prefill == 0 and c.stats.wasted_prefill_tokens == 0
    with pytest.raises(UnknownSequence):
        c.on_failed("r1")


def test_decode_load_sums_the_blocks_and_context_of_the_requests_alive_then():
    view = DecodeView()
    for _ in range(10):
        view.add(0.0, 1.0, ctx=20, blocks=2)  # ten small requests decoding now
    view.add(5.0, 6.0, ctx=1500, blocks=92)  # one long prompt, decoding later
    now = view.load_at(0.5)
    assert (now.requests, now.kv_blocks, now.context_tokens) == (10, 20, 200)
    later = view.load_at(5.5)
    assert (later.requests, later.kv_blocks) == (1, 92)
    assert view.peak(0.5, 5.5).kv_blocks == 92
    assert view.committed().kv_blocks == 112


def _promise_a_long_prompt(c: Conductor) -> None:
    """A 1460-token prompt (92 KV blocks with its output) on p0: decoding from ~1.46 s."""
    c.update_load("d0", InstanceLoad(free_kv_blocks=100, total_kv_blocks=100))
    d = c.route(make_request("long-prompt", blocks=60, extra=500), 0.0)
    assert (d.accepted, d.prefill_id) == (True, "p0")


def test_a_long_prompt_promised_later_does_not_count_against_requests_decoding_now(predictor):
    c = conductor(predictor, prefill=("p0", "p1"), rejection="predictive")
    _promise_a_long_prompt(c)
    for i in range(10):  # 2 blocks each, decoding from 0.2 s until before 1.46 s
        assert c.route(make_request(f"s{i}", blocks=1, max_tokens=10), 0.0).accepted
        c.on_prefill_done(f"s{i}", 0.2)
    assert c.route(make_request("next", blocks=1, max_tokens=5), 0.25).accepted  # 20 + 2 blocks


def test_predictive_keeps_the_room_promised_to_a_request_whose_prefill_ends_later(predictor):
    c = conductor(predictor, prefill=("p0", "p1"), rejection="predictive")
    _promise_a_long_prompt(c)
    # prefilled on p1 at once, then 200 steps: still decoding when the long prompt arrives
    d = c.route(make_request("long-decode", blocks=1, extra=0, max_tokens=200), 0.0)
    assert (d.accepted, d.reason) == (False, "decode_overloaded")


def test_predictive_admits_a_request_that_finishes_before_a_promised_one_starts(predictor):
    decisions = {}
    for rejection in ("early", "predictive"):
        c = conductor(predictor, prefill=("p0", "p1"), rejection=rejection)
        _promise_a_long_prompt(c)
        decisions[rejection] = c.route(make_request("short", blocks=10, extra=0, max_tokens=40), 0.0)
    assert not decisions["early"].accepted  # 92 + 13 blocks promised > 100
    assert decisions["predictive"].accepted  # decodes over ~[0.16, 1.0) s, before 1.46 s


def test_used_blocks_count_against_decode_only_for_untracked_running_requests(predictor):
    c = conductor(predictor, rejection="early")
    c.update_load("d0", InstanceLoad(running_decode_reqs=0, free_kv_blocks=10, total_kv_blocks=100))
    assert c.route(make_request("a", max_tokens=10), 0.0).accepted  # 21 blocks; nothing runs
    c.update_load("d0", InstanceLoad(running_decode_reqs=1, free_kv_blocks=10, total_kv_blocks=100))
    d = c.route(make_request("b", max_tokens=10), 0.0)  # 90 blocks of an untracked request + 21 + 21
    assert (d.accepted, d.reason) == (False, "decode_overloaded")


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(0, 30), st.integers(1, 400))
def test_predictive_admits_whatever_early_admits_in_the_same_state(history, blocks, max_tokens):
    c = conductor(make_predictor(), prefill=("p0", "p1"), decode=("d0", "d1"), tbt_slo_s=0.08)
    for inst in ("d0", "d1"):
        c.update_load(inst, InstanceLoad(free_kv_blocks=120, total_kv_blocks=120))
    routed: list[str] = []
    now = 0.0
    for step, (op, n) in enumerate(history):  # rejection "none": every request is admitted
        now += 0.01 * n
        if op == "route":
            c.route(make_request(f"r{step}", blocks=n % 5, max_tokens=n + 1), now)
            routed.append(f"r{step}")
        elif op == "prefill" and routed:
            c.on_prefill_done(routed[n % len(routed)], now)
    accepted = {}
    for rejection in ("early", "predictive"):
        twin = copy.deepcopy(c)
        twin.config = replace(c.config, rejection=rejection)
        accepted[rejection] = twin.route(make_request("x", blocks=blocks % 21, max_tokens=max_tokens), now).accepted
    assert accepted["predictive"] or not accepted["early"]
