"""Experiment: load or recompute a store hit (issue 32 item 3) — TTFT of a prompt whose document
sits in a store tier below the device cache, the tier fast (host DRAM over PCIe), a datacenter
NVMe SSD or slow (an SSD read at 100 MB/s: a throttled or networked disk), whole-block or
layer-wise, with and without the load-or-recompute planner.

The instance is `SimInstance` with a `SimStore`: the engine's scheduler plans the store hit, the
planner (`core/load_plan.py`, the engine's) cuts it where recomputing is cheaper, priced by the
cost model (`costs/load_costs.py`), and the roofline prices each step as the engine would run it
(whole-block: the reads before the forward; layer-wise: under it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvpool.core.kv_manager import KVCacheManager
from kvpool.costs.cost_model import RooflineCostModel
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import ExperimentResult, check_size, roofline
from kvpool.sim.instance import run_instance
from kvpool.sim.plots import plot_grouped_bars
from kvpool.sim.sim_store import SimStore
from kvpool.sim.tokens import BlockHasher, TokenSynth
from kvpool.sim.workloads import OUTPUT_CHUNK_BASE, SYNTHETIC_CHUNK_BASE, SimRequest

MODEL, HARDWARE = "llama2-7b", "a100-80gb"
BLOCK = 16
DOC, QUESTION, OUTPUT = 4096, 64, 16  # each request: its own stored document, then new tokens
GAP_S = 60.0  # one request at a time: TTFT is the request's own, not a queue's
# (label, store tier, its read bandwidth in bytes/s; None: the hardware preset's)
TIERS = (("host", "host", None), ("nvme", "disk", None), ("slow disk", "disk", 1e8))


def workload(n: int) -> list[SimRequest]:
    """`n` requests GAP_S apart, each a stored document of DOC tokens and a QUESTION."""
    return [SimRequest(f"req-{i}", i * GAP_S, DOC + QUESTION, OUTPUT,
                       ((SYNTHETIC_CHUNK_BASE + 2 * i, DOC), (SYNTHETIC_CHUNK_BASE + 2 * i + 1, QUESTION)),
                       OUTPUT_CHUNK_BASE + i) for i in range(n)]


def cost_model(bandwidth: float | None) -> RooflineCostModel:
    """The roofline of MODEL on HARDWARE, its disk read at `bandwidth` (None: the preset's)."""
    cost, _ = roofline(MODEL, HARDWARE, block_size=BLOCK)
    if bandwidth is not None:
        cost.transfers = dataclasses.replace(cost.transfers, disk_bandwidth=bandwidth)
    return cost


def load_run(tier: str | None, bandwidth: float | None, plan: bool, layerwise: bool, n: int) -> dict:
    """Mean TTFT of `n` requests whose documents the store `tier` holds (None: no store, every
    prompt computed), the share of stored blocks loaded and the stored tokens per request that the
    planner recomputed instead."""
    cost = cost_model(bandwidth)
    cfg = SchedulerConfig(num_blocks=4096, block_size=BLOCK, max_num_batched_tokens=8192, max_model_len=8192,
                          namespace=MODEL)  # one forward per prompt: the planner prices one
    reqs = workload(n)
    hasher = BlockHasher(BLOCK, TokenSynth())
    store = None
    if tier is not None:
        store = SimStore(KVCacheManager(2 * n * DOC // BLOCK, BLOCK), tier, plan, layerwise)  # room for all
        for r in reqs:
            store.put(hasher.hashes(r.chunks[:1]))
    run = run_instance(reqs, cfg, cost, hasher=hasher, store=store)
    ttfts = [m.ttft for m in run.metrics]
    return {"ttft_ms": sum(ttfts) / len(ttfts) * 1e3,
            "loaded": run.instance.counters.loaded_blocks / (n * DOC // BLOCK),
            "recomputed_for_speed": run.instance.sched.admission.num_recomputed_for_speed_tokens / n}


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    n = 16 if check_size(size) else 4  # identical requests one at a time: the size barely matters
    recompute = load_run(None, None, False, False, n)["ttft_ms"]
    rows = []
    for label, tier, bandwidth in TIERS:
        transfers = cost_model(bandwidth).transfers
        gb_s = (transfers.disk_bandwidth if tier == "disk" else transfers.pcie_bandwidth) / 1e9
        for layerwise in (False, True):
            for plan in (False, True):
                r = load_run(tier, bandwidth, plan, layerwise, n)
                rows.append({"tier": label, "read_gb_s": gb_s, "layerwise": layerwise, "planner": plan, **r,
                             "vs_recompute": r["ttft_ms"] / recompute})
    slow = {(r["layerwise"], r["planner"]): r["ttft_ms"] for r in rows if r["tier"] == "slow disk"}
    plots = []
    if out is not None:
        labels = [label for label, _, _ in TIERS]
        series = {f"{'layer-wise' if lw else 'whole-block'}{', planner' if plan else ''}":
                  [next(r["ttft_ms"] for r in rows if (r["tier"], r["layerwise"], r["planner"]) == (t, lw, plan))
                   for t in labels] for lw in (False, True) for plan in (False, True)}
        series["recompute (no store)"] = [recompute] * len(labels)
        plots.append(plot_grouped_bars(labels, series, out / "load_plan.png", "mean TTFT (ms)",
                                       f"A {DOC}-token stored document: load or recompute", logy=True))
    return ExperimentResult(
        "load_plan", "Load or recompute: TTFT of a store hit with and without the planner", rows,
        {"requests": n, "recompute_ttft_ms": recompute, "seed_unused": seed}, plots,
        setup=(f"{MODEL} on one {HARDWARE}; {n} requests one at a time, each a {DOC}-token document held by a "
               f"store tier below the device cache (not on the device) plus {QUESTION} new tokens, {OUTPUT} out. "
               "The tier is host DRAM over PCIe, one NVMe SSD, or a disk read at 0.1 GB/s; the hit is read "
               "whole before the forward or layer-wise under it (the engine's --kv-layerwise-load; the planner "
               "then prices the reads overlapped); the planner on or off (--kv-load-plan). loaded: share of "
               "the stored blocks loaded; recomputed_for_speed: stored tokens per request the planner computed; "
               f"vs_recompute: TTFT over the no-store TTFT ({recompute:.0f} ms)."),
        finding=(f"On the slow disk loading the hit costs {slow[(False, False)]:.0f} ms whole-block "
                 f"({slow[(True, False)]:.0f} ms layer-wise) against {recompute:.0f} ms to recompute it; with "
                 f"the planner it is recomputed and TTFT is the recompute figure ({slow[(False, True)]:.0f} ms; "
                 f"layer-wise {slow[(True, True)]:.0f} ms: the few blocks that read under the recompute load). "
                 "Whole-block, host DRAM and the NVMe SSD load the hit (all but its last blocks, which ride on "
                 "the weights' stream of the step that computes the question). Layer-wise, loading and "
                 "recomputing run side by side, so the planner splits the hit until the reads take as long as "
                 "the rest's compute: it loads less than the whole and TTFT falls below both."),
    )
