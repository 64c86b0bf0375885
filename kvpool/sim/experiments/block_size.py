"""Experiment 4: block size sweep (1..256 tokens) — slots lost in each sequence's last,
partially filled block, and the latency that follows, on ShareGPT-like and Alpaca-like loads.

The roofline cost model has no per-block kernel cost, so the small-block slowdown the vLLM
paper measures on GPUs (gathers of many tiny blocks) does not appear here; a measured profile
would carry it. What this sweep isolates is the memory effect of large blocks.
"""

from __future__ import annotations

from pathlib import Path

from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import ExperimentResult, check_size, roofline
from kvpool.sim.instance import run_instance
from kvpool.sim.metrics import summarize
from kvpool.sim.plots import plot_lines
from kvpool.sim.workloads import WorkloadSpec, synthetic_workload

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_LEN = 2048
RATES = {"sharegpt": 4.0, "alpaca": 80.0}  # above the 16-token system's capacity
# Share of the A100's KV budget each workload gets: Alpaca's short requests need a quarter of
# it before the KV, not max_num_seqs or the arrivals, limits the batch.
KV_SHARES = {"sharegpt": 1.0, "alpaca": 0.25}
# vLLM SOSP'23 Fig. 18: the block sizes that performed best on each workload.
PUBLISHED_BEST = {"sharegpt": (16, 128), "alpaca": (16, 32)}


def sweep_point(lengths: str, block_size: int, n: int, seed: int) -> dict:
    """One run at `block_size`: time-averaged empty share of allocated slots and latency."""
    cost, blocks = roofline("opt-13b", "a100-40gb", block_size=block_size)
    reqs = synthetic_workload(WorkloadSpec(num_requests=n, rate=RATES[lengths], lengths=lengths,
                                           max_len=MAX_LEN, seed=seed))
    cfg = SchedulerConfig(num_blocks=int(blocks * KV_SHARES[lengths]), block_size=block_size, max_num_batched_tokens=MAX_LEN,
                          max_model_len=MAX_LEN, enable_prefix_caching=False)
    acc = [0.0, 0.0, 0]  # empty-slot share of allocated, batch, steps

    def on_step(inst, now, res) -> None:
        u = inst.sched.kv.usage()
        allocated = u.used_blocks * u.block_size
        acc[0] += u.empty_slots / allocated if allocated else 0.0
        acc[1] += res.batch_size
        acc[2] += 1

    run = run_instance(reqs, cfg, cost, on_step=on_step)
    s = summarize(run.metrics)
    steps = max(acc[2], 1)
    return {"workload": lengths, "block_size": block_size, "last_block_waste": acc[0] / steps,
            "mean_batch": acc[1] / steps, "normalized_latency_s": s["normalized_latency_s"]["mean"],
            "preemptions": run.instance.sched.num_preemptions}


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    n = 1000 if full else 200
    rows = [sweep_point(w, b, n, seed) for w in RATES for b in BLOCK_SIZES]
    for r in rows:
        lo, hi = PUBLISHED_BEST[r["workload"]]
        r["published"] = "best range (Fig. 18)" if lo <= r["block_size"] <= hi else ""
    plots = []
    if out is not None:
        by = {w: [r for r in rows if r["workload"] == w] for w in RATES}
        plots.append(plot_lines(list(BLOCK_SIZES), {w: [r["last_block_waste"] for r in by[w]] for w in RATES},
                                out / "block_size_waste.png", "block size (tokens)",
                                "empty share of allocated KV slots", "Last-block waste vs block size"))
        plots.append(plot_lines(list(BLOCK_SIZES), {w: [r["normalized_latency_s"] for r in by[w]] for w in RATES},
                                out / "block_size_latency.png", "block size (tokens)",
                                "mean normalized latency (s/token)", "Latency vs block size", logy=True))
    return ExperimentResult(
        "block_size", "Block size sweep: last-block waste and latency", rows,
        {"requests": n, "rates_rps": RATES, "block_sizes": list(BLOCK_SIZES)}, plots,
        setup=(f"OPT-13B on one A100-40GB, the real scheduler at each block size; {n} Poisson requests at "
               f"{RATES['sharegpt']:g} req/s (ShareGPT-like, the whole KV budget) and {RATES['alpaca']:g} req/s "
               f"(Alpaca-like, {KV_SHARES['alpaca']:.0%} of it). What limits the batch: the KV memory in both "
               "(the preemptions column shows it binds; with the whole budget Alpaca's short requests hit "
               "max_num_seqs or the arrivals first and never preempt). last_block_waste = empty slots in "
               "allocated blocks over allocated slots, averaged over steps. Roofline costs carry no per-block "
               "kernel overhead, so small blocks show no slowdown here."),
        finding=("Waste grows with the block size: a sequence loses up to block_size-1 slots, so short "
                 "Alpaca-like sequences lose the largest share. Up to 16-32 tokens the waste is a few percent "
                 "and latency is nearly flat; beyond, the wasted slots shrink the batch that fits and raise "
                 "latency, most for Alpaca. On real GPUs very small blocks are slow for kernel reasons this "
                 "cost model leaves out (vLLM Fig. 18: 16-128 best on ShareGPT, 16-32 on Alpaca), which is why "
                 "16 is the usual choice."),
        published=("vLLM SOSP'23 Fig. 18 (OPT-13B): block sizes 16-128 perform best on ShareGPT, 16-32 on Alpaca, "
                   "larger blocks degrade Alpaca through waste, and blocks under 16 are slower through kernel "
                   "overhead (no per-row number published). The waste-driven degradation at large blocks is "
                   "reproduced; the small-block slowdown is a GPU-kernel effect the roofline does not model."),
    )
