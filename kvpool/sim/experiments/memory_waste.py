"""Experiment 1: where the KV memory goes — contiguous reservation (Max, Pow2, Oracle on a
buddy allocator) versus paged blocks under the real scheduler, ShareGPT-like overload."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvpool.core.contiguous import MaxPolicy, OraclePolicy, Pow2Policy
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import ExperimentResult, check_size, roofline
from kvpool.sim.instance import run_instance
from kvpool.sim.plots import plot_stacked_bars
from kvpool.sim.waste import PARTS, replay_contiguous
from kvpool.sim.workloads import WorkloadSpec, synthetic_workload

MAX_LEN = 2048
BLOCK = 16
MAX_TOKENS = 512  # what each request asks for; outputs stop there
# vLLM Fig. 2: share of KV memory holding token states, Orca baselines and vLLM (OPT-13B, A100-40GB).
PUBLISHED_TOKEN_SLOTS = {"max": 0.204, "pow2": 0.268, "oracle": 0.382, "paged": 0.963}


def paged_fractions(requests, num_slots: int, max_num_seqs: int = 256) -> tuple[dict[str, float], float]:
    """Time-averaged slot breakdown of the paged KV manager driven by the real scheduler."""
    cost, _ = roofline("opt-13b", "a100-40gb")
    cfg = SchedulerConfig(num_blocks=num_slots // BLOCK, block_size=BLOCK, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=MAX_LEN, max_model_len=MAX_LEN, enable_prefix_caching=False)
    totals = dict.fromkeys(PARTS, 0.0)
    batch = [0, 0]

    def on_step(inst, now, res) -> None:
        u = inst.sched.kv.usage()
        total = u.total_blocks * u.block_size
        totals["token_slots"] += u.token_slots / total
        totals["internal_frag_slots"] += u.empty_slots / total
        totals["free_slots"] += u.free_blocks * u.block_size / total
        batch[0] += res.batch_size
        batch[1] += 1

    run_instance([replace(r, arrival_s=0.0) for r in requests], cfg, cost, on_step=on_step)
    steps = max(batch[1], 1)
    return {p: v / steps for p, v in totals.items()}, batch[0] / steps


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    _, blocks = roofline("opt-13b", "a100-40gb")
    num_slots = blocks * BLOCK  # the whole KV budget; the buddy arena tiles it
    reqs = synthetic_workload(WorkloadSpec(num_requests=2000 if full else 600, rate=float("inf"),
                                           lengths="sharegpt", max_len=MAX_LEN, seed=seed))
    rows = []
    for policy in (MaxPolicy(MAX_LEN), Pow2Policy(), OraclePolicy()):
        rep = replay_contiguous(reqs, num_slots, policy, max_len=MAX_LEN, max_tokens=MAX_TOKENS)
        rows.append({"system": policy.name, **{p: rep.fractions[p] for p in PARTS}, "mean_batch": rep.mean_batch})
    fr, mean_batch = paged_fractions(reqs, num_slots)
    rows.append({"system": "paged", **fr, "mean_batch": mean_batch})
    for row in rows:
        row["published_token_slots"] = PUBLISHED_TOKEN_SLOTS[row["system"]]
    plots = []
    if out is not None:
        plots.append(plot_stacked_bars([r["system"] for r in rows], {p: [r[p] for r in rows] for p in PARTS},
                                       out / "memory_waste.png", "fraction of KV slots",
                                       "KV slot usage, OPT-13B on A100-40GB, ShareGPT overload"))
    return ExperimentResult(
        "memory_waste", "Memory waste: contiguous reservation vs paged KV", rows,
        {"num_slots": num_slots, "requests": len(reqs)}, plots,
        setup=(f"OPT-13B on one A100-40GB ({num_slots} KV slots: the budget after the weights, tiled by the buddy arena); "
               f"{len(reqs)} ShareGPT-like requests all queued at t=0 (overload); max length {MAX_LEN}. "
               "Slots are averaged over every iteration."),
        finding=("Contiguous systems keep a small share of their slots as token states: the rest is "
                 "reserved for future tokens, rounded up, or stranded between allocations. Paged blocks "
                 "keep most slots as tokens, with at most block_size-1 empty slots per sequence, and "
                 "batch several times more requests."),
        published=("vLLM SOSP'23 Fig. 2 (OPT-13B, A100-40GB, during the Fig. 13 ShareGPT run): token states "
                   "20.4% of the KV memory in Orca (Max), 26.8% (Pow2), 38.2% (Oracle), 96.3% in vLLM "
                   "(published_token_slots). Oracle matches; Max holds fewer tokens here because outputs stop at "
                   f"{MAX_TOKENS} tokens while it still reserves 2048; paged sits below 96% because this run "
                   "queues everything at t=0 and its average includes the drain, when slots go free."),
        columns=["system", *PARTS, "mean_batch", "published_token_slots"],
    )
