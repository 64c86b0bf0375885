"""Qualitative results of experiments 2-5, 7, 9, 10 and 13 that the report relies on, at reduced sizes."""

from kvpool.core.contiguous import OraclePolicy
from kvpool.costs.cost_model import RooflineCostModel
from kvpool.costs.presets import get_hardware, get_model
from kvpool.sim.experiments import (
    block_size,
    concurrency,
    latency_rate,
    pipeline_prefill,
    prefill_saved,
    shared_prefix,
    storage_vs_compute,
    swap_recompute,
)
from kvpool.sim.experiments.base import roofline
from kvpool.sim.tokens import BlockHasher, TokenSynth
from kvpool.sim.traces import TraceOptions, load_mooncake_trace

SLOTS = 8192


def test_paged_batches_more_requests_than_every_contiguous_policy():
    for lengths in ("sharegpt", "alpaca"):
        b = concurrency.mean_batches(lengths, 120, SLOTS, seed=0)
        assert b["paged"] > b["oracle"] > b["pow2"] > b["max"]


def test_contiguous_server_finishes_every_request_and_paged_beats_it_under_load():
    cost, _ = roofline("opt-13b", "a100-40gb")
    light = latency_rate.workload("sharegpt", 60, 0.25, seed=0)
    ms = latency_rate.ContiguousServer(SLOTS, OraclePolicy(), cost).run(light)
    by_id = {m.request_id: m for m in ms}
    assert len(ms) == 60
    for r in light:  # outputs stop at what the request asked for
        assert by_id[r.request_id].done
        assert by_id[r.request_id].output_len == min(r.output_len, latency_rate.MAX_TOKENS)
    heavy = latency_rate.workload("sharegpt", 100, 2.5, seed=0)
    paged = latency_rate.mean_normalized_latency("paged", heavy, SLOTS, cost)
    assert paged < latency_rate.mean_normalized_latency("oracle", heavy, SLOTS, cost)
    assert paged < latency_rate.mean_normalized_latency("max", heavy, SLOTS, cost)


def test_slo_search_finds_the_crossing_of_a_monotone_latency():
    found = latency_rate.max_rate_under_slo(lambda r: latency_rate.SLO_S * r / 3.0, 0.5, 2.0, iters=12)
    assert abs(found - 3.0) < 0.01
    assert latency_rate.max_rate_under_slo(lambda r: 1.0, 0.5, 2.0, iters=4) == 0.0


def test_last_block_waste_grows_with_block_size():
    waste = [block_size.sweep_point("alpaca", b, 60, seed=0)["last_block_waste"] for b in (1, 16, 256)]
    assert waste[0] == 0.0 < waste[1] < waste[2]


def test_swap_gets_slower_as_blocks_shrink_and_recompute_does_not_depend_on_block_size():
    times = []
    for b in (1, 16, 256):
        cost, _ = roofline("opt-13b", "a100-40gb", block_size=b)
        times.append(swap_recompute.recovery_times(cost, b))
    assert times[0][0] > times[1][0] > times[2][0]
    assert times[0][1] == times[1][1] == times[2][1]


def test_swap_mode_swaps_and_recompute_mode_recomputes_under_memory_pressure():
    swap = swap_recompute.end_to_end(16, "swap", 60, seed=0)
    rec = swap_recompute.end_to_end(16, "recompute", 60, seed=0)
    assert swap["preemptions"] > 0 and swap["swapped_blocks"] > 0 and swap["recomputed_prefill_tokens"] == 0
    assert rec["preemptions"] > 0 and rec["swapped_blocks"] == 0 and rec["recomputed_prefill_tokens"] > 0


def test_prefix_caching_saves_more_prefill_for_the_longer_shared_prefix_and_raises_throughput():
    rows = {(r["shots"], r["caching"]): r for r in
            (shared_prefix.prefix_run(s, c, 150, seed=0) for s in (1, 5) for c in (False, True))}
    assert rows[(5, "on")]["prefill_saved"] > rows[(1, "on")]["prefill_saved"] > 0.3
    for shots in (1, 5):
        assert rows[(shots, "on")]["throughput_rps"] > rows[(shots, "off")]["throughput_rps"]


def test_prefill_saved_grows_with_capacity_and_stays_below_the_hit_share():
    cost = RooflineCostModel(get_model("llama2-70b"), get_hardware("a800-80gb"), tp=8, block_size=prefill_saved.BLOCK)
    reqs = load_mooncake_trace("conversation", TraceOptions(max_requests=300))
    hasher = BlockHasher(prefill_saved.BLOCK, TokenSynth())
    prompts = [(r.prompt_len, hasher.hashes(r.chunks)) for r in reqs]
    total = sum(p for p, _ in prompts)
    saved = []
    for cap in (50, 500, 50_000):
        res = prefill_saved.prefill_saved(prompts, cap, cost)
        saved.append(1 - res["prefill_cached_s"] / res["prefill_s"])
        assert saved[-1] <= res["hit_tokens"] / total
    assert 0 <= saved[0] <= saved[1] <= saved[2] and saved[2] > 0.05


def test_every_tier_reads_a_token_faster_than_recompute_and_gqa_gains_most():
    rows = storage_vs_compute.per_token_rows((8192,))
    for r in rows:
        assert r["hbm_us"] < r["host_us"] <= r["disk_us"] < r["recompute_us"]
    speed = {r["model"]: r["disk_speedup"] for r in rows}
    assert speed["llama2-70b"] > speed["llama2-13b"] and speed["llama3-8b"] > speed["llama2-7b"]


def test_pipeline_stages_cut_ttft_and_pay_off_most_for_long_prompts():
    cost = RooflineCostModel(get_model("llama2-70b"), get_hardware("a800-80gb"), tp=8)
    for n in (8192, 131072):
        ttft = [pipeline_prefill.pipelined_ttft(cost, n, p) for p in (1, 2, 4, 8)]
        assert ttft == sorted(ttft, reverse=True)
    short = pipeline_prefill.pipelined_ttft(cost, 8192, 1) / pipeline_prefill.pipelined_ttft(cost, 8192, 8)
    long = pipeline_prefill.pipelined_ttft(cost, 131072, 1) / pipeline_prefill.pipelined_ttft(cost, 131072, 8)
    assert long > 2 * short
