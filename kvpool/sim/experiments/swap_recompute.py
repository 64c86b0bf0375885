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
    block out and back in over PCIe; recompute is a prefill of those tokens."""
    blocks = -(-tokens // block_size)
    swap = cost.transfers.movement_time(StepBatch([], [], blocks_swapped_in=blocks, blocks_swapped_out=blocks))
    return swap, cost.compute_time([tokens], [tokens])


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


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    n = 800 if full else 100
    micro = []
    for b in BLOCK_SIZES:
        cost, _ = roofline("opt-13b", "a100-40gb", block_size=b)
        swap, recompute = recovery_times(cost, b)
        micro.append({"block_size": b, "swap_s": swap, "recompute_s": recompute, "swap_over_recompute": swap / recompute})
    e2e = [end_to_end(b, mode, n, seed) for b in E2E_BLOCK_SIZES for mode in ("swap", "recompute")]
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
    return ExperimentResult(
        "swap_recompute", "Preemption recovery: swap vs recompute", micro + e2e,
        {"context_tokens": CONTEXT, "kv_share": KV_SHARE, "rate_rps": RATE, "requests": n}, plots,
        setup=(f"OPT-13B on one A100-40GB. Microbenchmark: bring back {CONTEXT} tokens of one sequence's KV, by "
               "swapping every block out and in over PCIe (25 GB/s plus 10 us per block copy) or by recomputing "
               f"them as one prefill (roofline). End to end: {n} ShareGPT-like requests at {RATE:g} req/s with "
               f"only {KV_SHARE:.0%} of the KV memory, so the real scheduler preempts; swap mode gets a host "
               "pool four times the device pool."),
        finding=("Swapping pays a fixed latency per block copy, so its cost rises as blocks shrink; from about "
                 "16 tokens up it is bandwidth-bound and flat. Recompute does not depend on the block size. With "
                 "these link numbers (10 us per copy) swapping stays cheaper than recomputing even for 1-token "
                 "blocks; a higher per-copy cost, as on the GPUs vLLM measured, moves the crossover up. End to "
                 "end swap is slightly ahead at every block size, and both lose to large blocks' waste."),
        columns=["block_size", "swap_s", "recompute_s", "swap_over_recompute", "mode", "normalized_latency_s",
                 "preemptions", "swapped_blocks", "recomputed_prefill_tokens"],
    )
