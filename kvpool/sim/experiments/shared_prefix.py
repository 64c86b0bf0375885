"""Experiment 7: a few-shot prefix every prompt shares (1-shot ~80, 5-shot ~341 tokens) —
prefill tokens prefix caching saves, and the throughput it buys, caching on vs off."""

from __future__ import annotations

from pathlib import Path

from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import ExperimentResult, check_size, roofline
from kvpool.sim.instance import simulate_offline
from kvpool.sim.metrics import summarize
from kvpool.sim.plots import plot_grouped_bars
from kvpool.sim.workloads import FEW_SHOT_PREFIX, WorkloadSpec, synthetic_workload

BLOCK = 16
MAX_LEN = 2048


# vLLM SOSP'23 Fig. 17: throughput of vLLM sharing the prefix over Orca (Oracle), by shots.
PUBLISHED_GAIN = {1: "1.67x Orca (Oracle) (Fig. 17)", 5: "3.58x Orca (Oracle) (Fig. 17)"}


def prefix_run(shots: int, caching: bool, n: int, seed: int) -> dict:
    """Every request queued at t=0 (throughput-style); Alpaca-like questions after the prefix."""
    cost, blocks = roofline("llama2-13b", "a100-40gb", block_size=BLOCK)
    reqs = synthetic_workload(WorkloadSpec(num_requests=n, rate=float("inf"), lengths="alpaca", max_len=MAX_LEN,
                                           shared_prefix_len=FEW_SHOT_PREFIX[shots], seed=seed))
    cfg = SchedulerConfig(num_blocks=blocks, block_size=BLOCK, max_num_batched_tokens=MAX_LEN, max_model_len=MAX_LEN,
                          enable_prefix_caching=caching, namespace="llama2-13b")
    run = simulate_offline(reqs, cfg, cost)
    s = summarize(run.metrics)
    prompt = sum(r.prompt_len for r in reqs)
    return {"shots": shots, "prefix_tokens": FEW_SHOT_PREFIX[shots], "caching": "on" if caching else "off",
            "prompt_tokens": prompt, "prefill_tokens": run.instance.counters.prefill_tokens,
            "prefill_saved": 1 - run.instance.counters.prefill_tokens / prompt,
            "throughput_rps": s["throughput_rps"], "mean_batch": run.instance.counters.batched_requests
            / max(run.instance.counters.steps, 1)}


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    n = 3000 if full else 500
    rows = [prefix_run(shots, caching, n, seed) for shots in FEW_SHOT_PREFIX for caching in (False, True)]
    for r in rows:
        r["published"] = PUBLISHED_GAIN[r["shots"]] if r["caching"] == "on" else ""
    plots = []
    if out is not None:
        cats = [f"{s}-shot" for s in FEW_SHOT_PREFIX]
        plots.append(plot_grouped_bars(cats, {f"caching {c}": [r["throughput_rps"] for r in rows if r["caching"] == c]
                                              for c in ("off", "on")},
                                       out / "shared_prefix.png", "throughput (req/s)",
                                       "Shared few-shot prefix, LLaMA2-13B on A100-40GB"))
    return ExperimentResult(
        "shared_prefix", "Shared few-shot prefix: prefix caching on vs off", rows,
        {"requests": n, "prefix_tokens": FEW_SHOT_PREFIX}, plots,
        setup=(f"LLaMA2-13B on one A100-40GB, {BLOCK}-token blocks; {n} Alpaca-like questions queued at t=0, each "
               "after the same 1-shot (80-token) or 5-shot (341-token) prefix, as in few-shot translation. "
               "prefill_tokens counts prompt tokens computed; throughput is requests over the makespan."),
        finding=("With caching on, the prefix's full blocks are computed once and then shared in place: the "
                 "5-shot prefix makes up most of each prompt, so most prefill work disappears, and sharing the "
                 "prefix's blocks leaves memory for larger batches. The 1-shot prefix saves less because it "
                 "is a smaller share of each prompt (and its partial last block is never shared)."),
        published=("vLLM SOSP'23 §6.4 / Fig. 17 (LLaMA-13B, WMT16 translation): sharing the 1-shot prefix gives "
                   "1.67x the throughput of Orca (Oracle), the 5-shot prefix 3.58x. kvpool compares prefix caching "
                   "on vs off in the same paged system, a different baseline, so its ratios are smaller; the "
                   "direction (more shots, more gain) agrees."),
    )
