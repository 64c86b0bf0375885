"""The load-or-recompute planner: the k it picks is the cheapest under the model it is given,
it never loads less when a tier gets faster, and the online estimate recovers a line."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.load_plan import (
    LinearEstimate,
    LoadEstimates,
    ReadCost,
    break_even_bandwidth,
    plan_load,
)

B = 16
TIERS = ("host", "disk", "remote")


def linear_prefill(per_token: float, per_step: float = 0.0):
    return lambda cached, new: per_step + per_token * new if new > 0 else 0.0


def cost(tiers, est, start, prompt_len, k):
    """Loading k blocks: the reads of tiers not overlapped first, then the first forward, which
    takes the longer of its share of the recompute and the overlapped tiers' reads, then the rest
    of the recompute."""
    done = start + k * B
    compute = est.prefill_s(done, prompt_len - done)
    if est.first_forward_tokens is not None and prompt_len - done > est.first_forward_tokens:
        head = est.prefill_s(done, est.first_forward_tokens)
    else:
        head = compute
    first = under = 0.0
    for t in tiers[:k]:
        if t not in est.read:
            continue
        hidden = est.overlap is True or (not isinstance(est.overlap, bool) and t in est.overlap)
        if hidden:
            under += est.read[t].seconds(est.block_bytes)
        else:
            first += est.read[t].seconds(est.block_bytes)
    return first + max(under, head) + compute - head


hits = st.lists(st.sampled_from(TIERS), min_size=0, max_size=24)
bandwidths = st.floats(1e4, 1e11)
latencies = st.floats(0.0, 0.05)
overlaps = st.one_of(st.booleans(), st.frozensets(st.sampled_from(TIERS)))
first_forwards = st.one_of(st.none(), st.integers(1, 200))


@settings(max_examples=200, deadline=None)
@given(hits, st.integers(0, 8), st.integers(1, 40), st.dictionaries(st.sampled_from(TIERS),
       st.tuples(latencies, bandwidths)), st.floats(1e-6, 1e-2), st.floats(0, 0.05), overlaps, first_forwards)
def test_the_chosen_k_minimizes_the_models_cost(tiers, start_blocks, tail, read, per_token, per_step, overlap,
                                                first_forward):
    est = LoadEstimates({t: ReadCost(*lb) for t, lb in read.items()}, 2**18, linear_prefill(per_token, per_step),
                        overlap, first_forward)
    start, prompt_len = start_blocks * B, (start_blocks + len(tiers)) * B + tail
    plan = plan_load(tiers, est, start, prompt_len, B)
    costs = [cost(tiers, est, start, prompt_len, k) for k in range(len(tiers) + 1)]
    assert plan.total_s == pytest.approx(min(costs), rel=1e-9, abs=1e-15)
    assert plan.recompute_s == pytest.approx(costs[0]) and plan.all_load_s == pytest.approx(costs[-1])
    assert 0 <= plan.blocks <= len(tiers)


@settings(max_examples=200, deadline=None)
@given(hits, st.integers(1, 40), st.sampled_from(TIERS), latencies, bandwidths, st.floats(1.01, 100.0),
       st.floats(1e-6, 1e-2), overlaps)
def test_a_faster_tier_never_loads_fewer_blocks(tiers, tail, tier, latency, bw, faster, per_token, overlap):
    read = {t: ReadCost(0.001, 1e9) for t in TIERS}
    slow = LoadEstimates({**read, tier: ReadCost(latency, bw)}, 2**18, linear_prefill(per_token), overlap)
    fast = LoadEstimates({**read, tier: ReadCost(latency, bw * faster)}, 2**18, linear_prefill(per_token), overlap)
    prompt_len = len(tiers) * B + tail
    before, after = plan_load(tiers, slow, 0, prompt_len, B), plan_load(tiers, fast, 0, prompt_len, B)
    # monotone up to float rounding: a smaller k only if it costs the same within rounding
    assert after.blocks >= before.blocks or cost(tiers, fast, 0, prompt_len, before.blocks) == pytest.approx(
        after.total_s, rel=1e-9)


def test_a_slow_tier_is_recomputed_and_a_fast_one_loaded():
    prefill = linear_prefill(1e-3)  # 16 ms a block
    fast = LoadEstimates({"disk": ReadCost(1e-4, 2e9)}, 2**18, prefill)
    slow = LoadEstimates({"disk": ReadCost(0.3, 2e9)}, 2**18, prefill)
    assert plan_load(["disk"] * 8, fast, 0, 130, B).blocks == 8
    plan = plan_load(["disk"] * 8, slow, 0, 130, B)
    assert plan.blocks == 0 and plan.total_s == plan.recompute_s < plan.all_load_s


def test_an_unmeasured_tier_is_loaded_whole_and_a_mixed_hit_stops_at_the_slow_tier():
    prefill = linear_prefill(1e-3)
    assert plan_load(["remote"] * 4, LoadEstimates({}, 2**18, prefill), 0, 70, B).blocks == 4
    est = LoadEstimates({"host": ReadCost(1e-5, 1e10), "remote": ReadCost(0.2, 1e8)}, 2**18, prefill)
    assert plan_load(["host"] * 3 + ["remote"] * 3, est, 32, 32 + 6 * B + 5, B).blocks == 3


def test_overlap_loads_what_hides_under_the_recompute():
    prefill = linear_prefill(1e-3)
    est = LoadEstimates({"disk": ReadCost(0.02, 1e12)}, 2**18, prefill)  # a block reads in 20 ms, computes in 16
    assert plan_load(["disk"] * 8, est, 0, 8 * B + 1, B).blocks == 0
    overlapped = LoadEstimates(est.read, est.block_bytes, prefill, overlap=True)
    assert 0 < plan_load(["disk"] * 8, overlapped, 0, 8 * B + 1, B).blocks < 8


@settings(max_examples=200, deadline=None)
@given(hits, st.integers(1, 40), st.dictionaries(st.sampled_from(TIERS), st.tuples(latencies, bandwidths)),
       st.floats(1e-6, 1e-2), overlaps)
def test_overlapping_reads_never_plan_a_slower_prefill_and_all_tiers_is_true(tiers, tail, read, per_token, overlap):
    read = {t: ReadCost(*lb) for t, lb in read.items()}
    prompt_len = len(tiers) * B + tail

    def plan(o):
        return plan_load(tiers, LoadEstimates(read, 2**18, linear_prefill(per_token), o), 0, prompt_len, B)

    assert plan(overlap).total_s <= plan(False).total_s
    assert plan(True).total_s <= plan(overlap).total_s
    assert plan(frozenset(TIERS)) == plan(True) and plan(frozenset()) == plan(False)


def test_a_tier_read_under_the_forward_loads_what_hides_and_one_read_first_does_not():
    prefill = linear_prefill(1e-3)  # 16 ms a block
    slow = ReadCost(0.02, 1e12)  # 20 ms a block: slower than computing it
    est = LoadEstimates({"disk": slow, "remote": slow}, 2**18, prefill, overlap=frozenset({"disk"}))
    assert est.overlaps("disk") and not est.overlaps("remote") and not est.overlaps(None)
    disk = plan_load(["disk"] * 8, est, 0, 8 * B + 1, B)
    # k blocks read under the recompute of the rest: max(20k, 16(8 - k) + 1) ms is least at k = 4
    assert disk.blocks == 4 and disk.total_s == pytest.approx(0.080, rel=1e-3)
    assert plan_load(["remote"] * 8, est, 0, 8 * B + 1, B).blocks == 0
    # a hit that starts in the read-first tier pays that part before the forward, the rest under it
    mixed = plan_load(["remote"] * 2 + ["disk"] * 6, est, 0, 8 * B + 1, B)
    assert mixed.blocks == 5 and mixed.total_s == pytest.approx(0.040 + 0.060, rel=1e-3)


def test_reads_under_the_forward_hide_under_its_first_chunk_only():
    """A chunked prefill reads a layer-wise load under its first forward: a long recompute does
    not hide reads beyond what that first chunk computes."""
    prefill = linear_prefill(1e-3)  # 16 ms a block
    read = {"disk": ReadCost(0.02, 1e12)}  # 20 ms a block
    whole = LoadEstimates(read, 2**18, prefill, overlap=True)
    chunked = LoadEstimates(read, 2**18, prefill, overlap=True, first_forward_tokens=2 * B)
    # 16 blocks, the whole recompute as cover: max(20 k, 16 (16 - k) + 1) ms is least at k = 7 (145 ms)
    assert plan_load(["disk"] * 16, whole, 0, 16 * B + 1, B).blocks == 7
    # a first forward of 32 tokens (32 ms) covers the reads only that far: 40 ms of reads for two
    # blocks, then the rest of the 225 ms recompute (193 ms) is 233 ms; three cost 60 + 177 = 237
    plan = plan_load(["disk"] * 16, chunked, 0, 16 * B + 1, B)
    assert plan.blocks == 2 and plan.total_s == pytest.approx(0.040 + 0.225 - 0.032, rel=1e-3)


def test_a_hit_past_the_prompt_is_refused():
    with pytest.raises(ValueError, match="past the prompt"):
        plan_load(["host"] * 4, LoadEstimates({}, 1, linear_prefill(1e-3)), 0, 64, B)


def test_break_even_bandwidth_is_where_the_plan_flips():
    est = LoadEstimates({"disk": ReadCost(1e-4, 1e9)}, 2**20, linear_prefill(1e-3))
    bw = break_even_bandwidth(est, "disk", 0, 8 * B + 1, B, 8)
    # 8 reads of 1 MiB at 0.1 ms + bytes/bw against 8 * 16 ms of compute
    assert bw == pytest.approx(2**20 / (16e-3 - 1e-4), rel=1e-3)
    assert break_even_bandwidth(LoadEstimates({"disk": ReadCost(1.0, 1e9)}, 2**20, linear_prefill(1e-3)),
                                "disk", 0, 8 * B + 1, B, 8) is None


def test_the_online_estimate_finds_latency_and_bandwidth():
    est = LinearEstimate(alpha=0.25)
    assert est.read_cost() is None
    for n in (1000, 5000, 2000, 8000) * 5:
        est.update(n, 0.002 + n / 1e6)
    cost = est.read_cost()
    assert cost.latency_s == pytest.approx(0.002) and cost.bandwidth == pytest.approx(1e6)
    same = LinearEstimate()
    for _ in range(4):
        same.update(4096, 0.004)  # one size only: all of it is per byte
    assert same.read_cost() == ReadCost(0.0, pytest.approx(4096 / 0.004))
    for _ in range(12):
        same.update(4096, 0.4)  # the tier slowed down: the estimate follows within a few reads
    assert same.read_cost().seconds(4096) > 0.35


def test_a_noisy_line_prices_more_work_higher_never_free():
    est = LinearEstimate()
    for x, y in ((1, 0.05), (1, 0.06), (15, 0.04), (1, 0.05)):  # a prefill that ran faster than decodes
        est.update(x, y)
    intercept, slope = est.line()
    assert intercept == 0.0 and slope > 0  # through the origin: per-token cost, so recompute is not free
    est.update(0, 0.0)
    assert est.line()[1] > 0
