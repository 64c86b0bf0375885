"""Load or recompute in the simulator (issue 32 item 3): the engine's planner, priced by the cost
model, recomputes a store hit on a slow tier (TTFT stays at the recompute figure) and loads it
from a fast one; layer-wise it splits the hit and beats both loading all and recomputing all."""

import pytest

from kvpool.sim.experiments import get_experiment
from kvpool.sim.experiments import load_plan as exp

N = 2


def test_a_slow_tier_is_recomputed_and_ttft_stays_at_the_recompute_figure():
    recompute = exp.load_run(None, None, False, False, N)
    planned = exp.load_run("disk", 1e8, True, False, N)
    assert planned["loaded"] == 0.0 and planned["recomputed_for_speed"] == exp.DOC
    assert planned["ttft_ms"] == pytest.approx(recompute["ttft_ms"], rel=1e-9)
    unplanned = exp.load_run("disk", 1e8, False, False, N)  # the tier is used whatever it costs
    assert unplanned["loaded"] == 1.0 and unplanned["ttft_ms"] > 10 * recompute["ttft_ms"]


def test_a_fast_tier_is_loaded():
    recompute = exp.load_run(None, None, False, False, N)["ttft_ms"]
    host = exp.load_run("host", None, True, False, N)
    assert host["loaded"] > 0.95 and host["ttft_ms"] < recompute / 2
    assert host["ttft_ms"] <= exp.load_run("host", None, False, False, N)["ttft_ms"]


def test_layerwise_the_planner_splits_the_hit_and_beats_loading_all_and_recomputing_all():
    recompute = exp.load_run(None, None, False, False, N)["ttft_ms"]
    all_loaded = exp.load_run("disk", None, False, True, N)
    planned = exp.load_run("disk", None, True, True, N)
    assert 0.2 < planned["loaded"] < 0.9
    assert planned["ttft_ms"] < 0.75 * min(recompute, all_loaded["ttft_ms"])
    whole = exp.load_run("disk", None, True, False, N)  # read first: loading and computing add up
    assert planned["ttft_ms"] < whole["ttft_ms"]


def test_the_experiment_reports_every_tier_with_and_without_the_planner():
    res = get_experiment("load-or-recompute")("small", 0, None)
    assert len(res.rows) == 4 * len(exp.TIERS)
    slow = [r for r in res.rows if r["tier"] == "slow disk" and not r["layerwise"]]
    assert [r["planner"] for r in slow] == [False, True] and slow[1]["vs_recompute"] == pytest.approx(1.0)
