"""Experiment 5: recovering preempted KV by swapping (PCIe copies of each block, out and back)
vs recomputing its tokens — per block size in isolation, and end to end under memory pressure
with the real scheduler's two preemption modes."""

from __future__ import annotations

from pathlib import Path

from kvpool.costs.cost_model import RooflineCostModel, StepBatch
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import ExperimentResult, check_size, roofline
from kvpool.sim.instance import run_instance
from kvpool.sim.metrics import summarize
from kvpool.sim.plots import plot_lines
from kvpool.sim.workloads import WorkloadSpec, synthetic_workload

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
E2E_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
CONTEXT = 1024  # tokens of KV to recover in the microbenchmark
MAX_LEN = 2048
KV_SHARE = 0.25  # share of the A100's KV capacity left for the end-to-end runs (memory pressure)
RATE = 1.5


def recovery_times(cost: RooflineCostModel, block_size: int, tokens: int = CONTEXT) -> tuple[float, float]:
    """(swap, recompute) seconds to bring back `tokens` of one sequence's KV: swap moves each
    block out and back in over PCIe, one copy per layer and per K and V; recompute is a prefill
    of those tokens."""
    blocks = -(-tokens // block_size)
    swap = cost.transfers.movement_time(StepBatch([], [], blocks_swapped_in=blocks, blocks_swapped_out=blocks))
    return swap, cost.compute_time([tokens], [tokens])


def crossover_block_size(cost: RooflineCostModel, tokens: int = CONTEXT) -> float:
    """The block size at which swapping `tokens` out and in costs as much as recomputing them:
    2 * (tokens / b) * copies * latency + 2 * tokens * bytes / bandwidth = recompute, for b
    (inf when the bytes alone cost more than recomputing)."""
    tr = cost.transfers
    bytes_s = 2 * tokens * cost.tp.kv_bytes_per_token_per_gpu() / tr.pcie_bandwidth
    spare = cost.compute_time([tokens], [tokens]) - bytes_s
    return 2 * tokens * tr.copies_per_swap * tr.pcie_latency / spare if spare > 0 else float("inf")


def end_to_end(block_size: int, mode: str, n: int, seed: int) -> dict:
    cost, blocks = roofline("opt-13b", "a100-40gb", block_size=block_size)
    device = int(blocks * KV_SHARE)
    reqs = synthetic_workload(WorkloadSpec(num_requests=n, rate=RATE, lengths="sharegpt", max_len=MAX_LEN, seed=seed))
    cfg = SchedulerConfig(num_blocks=device, block_size=block_size, max_num_batched_tokens=MAX_LEN,
                          max_model_len=MAX_LEN, enable_prefix_caching=False, preemption_mode=mode,
                          num_host_blocks=4 * device if mode == "swap" else 0)
    run = run_instance(reqs, cfg, cost)
    s = summarize(run.metrics)
    return {"block_size": block_size, "mode": mode, "normalized_latency_s": s["normalized_latency_s"]["mean"],
            "preemptions": run.instance.sched.num_preemptions,
            "swapped_blocks": run.instance.sched.num_swapped_blocks,
            "recomputed_prefill_tokens": run.instance.counters.prefill_tokens - sum(r.prompt_len for r in reqs)}


# vLLM §7.3 / Fig. 19 (OPT-13B, A100): what the paper reports per block size.
PUBLISHED_MICRO = {1: "recompute faster (Fig. 19a)", 256: "swap faster (Fig. 19a)"}
PUBLISHED_E2E = "16-64: comparable (Fig. 19b)"


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    n = 800 if full else 100
    micro = []
    for b in BLOCK_SIZES:
        cost, _ = roofline("opt-13b", "a100-40gb", block_size=b)
        swap, recompute = recovery_times(cost, b)
        micro.append({"block_size": b, "swap_s": swap, "recompute_s": recompute, "swap_over_recompute": swap / recompute,
                      "published": PUBLISHED_MICRO.get(b, "")})
    crossover = crossover_block_size(cost)
    copies = cost.transfers.copies_per_swap
    e2e = [end_to_end(b, mode, n, seed) for b in E2E_BLOCK_SIZES for mode in ("swap", "recompute")]
    for r in e2e:
        r["published"] = PUBLISHED_E2E if 16 <= r["block_size"] <= 64 else ""
    plots = []
    if out is not None:
        plots.append(plot_lines(list(BLOCK_SIZES), {"swap (out + in)": [r["swap_s"] for r in micro],
                                                    "recompute": [r["recompute_s"] for r in micro]},
                                out / "swap_recompute_micro.png", "block size (tokens)", "seconds",
                                f"Recovering {CONTEXT} tokens of KV, OPT-13B / A100", logy=True))
        plots.append(plot_lines(list(E2E_BLOCK_SIZES),
                                {m: [r["normalized_latency_s"] for r in e2e if r["mode"] == m] for m in ("swap", "recompute")},
                                out / "swap_recompute_e2e.png", "block size (tokens)",
                                "mean normalized latency (s/token)", "Swap vs recompute under memory pressure"))
    tr = cost.transfers
    lat = {(r["block_size"], r["mode"]): r["normalized_latency_s"] for r in e2e}
    winner = {b: min(("swap", "recompute"), key=lambda m, b=b: lat[(b, m)]) for b in E2E_BLOCK_SIZES}
    e2e_text = ", ".join(f"{b}: {winner[b]}" for b in E2E_BLOCK_SIZES)
    return ExperimentResult(
        "swap_recompute", "Preemption recovery: swap vs recompute", micro + e2e,
        {"context_tokens": CONTEXT, "kv_share": KV_SHARE, "rate_rps": RATE, "requests": n,
         "crossover_block_size": crossover, "copies_per_swapped_block": copies}, plots,
        setup=(f"OPT-13B on one A100-40GB. Microbenchmark: bring back {CONTEXT} tokens of one sequence's KV, by "
               f"swapping every block out and in over PCIe ({tr.pcie_bandwidth / 1e9:g} GB/s plus "
               f"{tr.pcie_latency * 1e6:g} us per copy, {copies} copies per block: K and V of each of the 40 "
               "layers, as a paged engine issues them) or by recomputing them as one prefill (roofline). End to "
               f"end: {n} ShareGPT-like requests at {RATE:g} req/s with only {KV_SHARE:.0%} of the KV memory, so "
               "the real scheduler preempts (memory limits the batch); swap mode gets a host pool four times "
               "the device pool."),
        finding=(f"Swapping pays a fixed cost per copy and a block takes {copies} copies, so its cost grows as "
                 "blocks shrink, to ~10x recompute at 1-token blocks; large blocks are bandwidth-bound and "
                 "flat, ~0.4x recompute. Recompute does not depend on the block size. The two cross at "
                 f"{crossover:.1f}-token blocks with these link numbers (the lecture derives 16-32; the vLLM "
                 "paper measures recompute faster for small blocks, swap for large, comparable at 16-64). End to "
                 f"end the lower latency per block size is {e2e_text}; the two stay within a few percent from 16 "
                 "tokens up, and both lose to large blocks' waste."),
        published=("vLLM SOSP'23 Fig. 19 (OPT-13B): (a) swapping is slower than recomputing for small blocks "
                   "and faster for large ones; (b) end to end the two are comparable for 16-64-token blocks. The "
                   "lecture (§6.2) derives the crossover between 16 and 32 tokens. kvpool's crossover comes out "
                   "just under 16 with the A100 preset's link (25 GB/s, 10 us per copy); the lecture's exact link "
                   "numbers were not available here, and a per-copy cost of 11-20 us would put it inside 16-32."),
        columns=["block_size", "swap_s", "recompute_s", "swap_over_recompute", "mode", "normalized_latency_s",
                 "preemptions", "swapped_blocks", "recomputed_prefill_tokens", "published"],
    )
