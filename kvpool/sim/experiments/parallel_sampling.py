"""Experiment 6: parallel sampling (n = 2, 4, 6) and beam search (k = 2, 4, 6) — KV blocks
saved by sharing and tokens copied by copy-on-write, against a system that copies each
sample's KV (one private copy of the prompt per extra sample, no sharing)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import ExperimentResult, check_size, roofline
from kvpool.sim.instance import run_instance
from kvpool.sim.plots import plot_lines
from kvpool.sim.workloads import WorkloadSpec, synthetic_workload

BLOCK = 16
WIDTHS = (2, 4, 6)
# vLLM SOSP'23 §6.3 / Fig. 15: KV memory saved by sharing on ShareGPT over widths 2-6.
PUBLISHED_SAVED = {"parallel": "16.2-30.5%", "beam": "44.3-66.3%"}


def sharing_stats(num_requests: int, width: int, beam: bool, seed: int = 0) -> dict:
    """Run `width`-way sampling through the real scheduler; compare its block use and copies
    with what private per-sample copies would take."""
    cost, blocks = roofline("opt-13b", "a100-40gb", block_size=BLOCK)
    spec = WorkloadSpec(num_requests=num_requests, rate=float("inf"), lengths="sharegpt", seed=seed,
                        n=1 if beam else width, beam_width=width if beam else 1)
    reqs = synthetic_workload(spec)
    cfg = SchedulerConfig(num_blocks=blocks, block_size=BLOCK, max_num_batched_tokens=width * 2048,
                          max_model_len=2048, enable_prefix_caching=False)
    used = [0.0, 0.0, 0]  # paged blocks, private-copy blocks, samples

    def on_step(inst, now, res) -> None:
        kv = inst.sched.kv
        private = sum(-(-kv.seq(s.seq_id).num_tokens // BLOCK) for g in inst.sched.running for s in g.live_seqs)
        used[0] += kv.usage().used_blocks
        used[1] += private
        used[2] += 1

    run = run_instance([replace(r) for r in reqs], cfg, cost, on_step=on_step)
    kv = run.instance.sched.kv
    cow_tokens = kv.num_cow_copies * BLOCK  # upper bound: a copied block holds < BLOCK tokens
    copy_tokens = sum((width - 1) * r.prompt_len for r in reqs)
    if beam:  # a copying beam search also copies the branching beam's whole context every step
        copy_tokens += sum(r.output_len * (r.prompt_len + r.output_len // 2) for r in reqs)
    return {
        "mode": "beam" if beam else "parallel", "width": width,
        "kv_saved": 1 - used[0] / max(used[1], 1),
        "cow_tokens_copied": cow_tokens, "copying_tokens_copied": copy_tokens,
        "mean_batch": run.instance.counters.batched_requests / max(run.instance.counters.steps, 1),
    }


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    n = 400 if full else 40
    rows = [sharing_stats(n, w, beam, seed) for beam in (False, True) for w in WIDTHS]
    for r in rows:
        r["published_kv_saved"] = PUBLISHED_SAVED[r["mode"]]
    plots = []
    if out is not None:
        plots.append(plot_lines(list(WIDTHS), {
            "parallel sampling": [r["kv_saved"] for r in rows if r["mode"] == "parallel"],
            "beam search": [r["kv_saved"] for r in rows if r["mode"] == "beam"],
        }, out / "parallel_sampling.png", "samples / beams", "KV blocks saved by sharing",
            "KV saved by block sharing, OPT-13B, ShareGPT-like"))
    return ExperimentResult(
        "parallel_sampling", "Parallel sampling and beam search: sharing vs copying", rows,
        {"requests": n}, plots,
        setup=(f"{n} ShareGPT-like requests queued at t=0 on OPT-13B / A100-40GB, {BLOCK}-token blocks. "
               "kv_saved = 1 - blocks in use / blocks private per-sample copies would need, averaged "
               "over steps. Beam search is the core's own (the engine's), fed by a seeded stand-in "
               "for the model: each beam offers continuations whose logprobs fall by Exp(1) draws."),
        finding=("Samples of one request share the prompt's blocks; only the partially filled last block "
                 "is copied on the first write, so copy-on-write moves a few blocks per sample where a "
                 "copying system duplicates the whole prompt. Beams share more because they share "
                 "generated history as well."),
        published=("vLLM SOSP'23 §6.3 / Fig. 15 (OPT-13B): sharing saves 6.1-9.8% of KV memory for parallel "
                   "sampling and 37.6-55.2% for beam search on Alpaca, 16.2-30.5% and 44.3-66.3% on ShareGPT, "
                   "rising with the width. kvpool's parallel saving is lower than the ShareGPT range: the average "
                   "is over every step of an offline run whose KV is full, so the long tail, where a few "
                   "long-output requests with short prompts (little to share) run alone, weighs heavily; the paper "
                   "averages over serving at a steady rate. Beam search's saving rises with the width, as "
                   "published, and exceeds the ShareGPT range at widths 4-6, probably because the stand-in's beams share "
                   "their history longer than real beams, whose candidates diverge on the model's scores."),
    )
