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


def sharing_stats(num_requests: int, width: int, beam: bool, seed: int = 0, preemption: str = "swap") -> dict:
    """Run `width`-way sampling through the real scheduler; compare its block use and copies
    with what private per-sample copies would take."""
    cost, blocks = roofline("opt-13b", "a100-40gb", block_size=BLOCK)
    spec = WorkloadSpec(num_requests=num_requests, rate=float("inf"), lengths="sharegpt", seed=seed,
                        n=1 if beam else width, beam_width=width if beam else 1)
    reqs = synthetic_workload(spec)
    # Preempted groups are swapped, as vLLM does with a group of several sequences (it never
    # recomputes one: recomputing re-prefills every sample's own copy of the prompt, so the group
    # shares nothing afterwards), to a host pool as large as the device's so a swap never fails.
    cfg = SchedulerConfig(num_blocks=blocks, block_size=BLOCK, max_num_batched_tokens=width * 2048,
                          max_model_len=2048, enable_prefix_caching=False, preemption_mode=preemption,
                          num_host_blocks=blocks if preemption == "swap" else 0)
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
    # Without preemption or block rounding, a request's samples share its prompt P while each
    # grows its own output to O: summed over its O steps, (n-1) P O blocks of n (P O + O^2 / 2).
    po = sum(r.prompt_len * r.output_len for r in reqs)
    oo = sum(r.output_len * r.output_len / 2 for r in reqs)
    return {
        "mode": "beam" if beam else "parallel", "width": width, "preemption": preemption,
        "kv_saved": 1 - used[0] / max(used[1], 1),
        "analytic_kv_saved": None if beam else (width - 1) * po / (width * (po + oo)),
        "cow_tokens_copied": cow_tokens, "copying_tokens_copied": copy_tokens,
        "mean_batch": run.instance.counters.batched_requests / max(run.instance.counters.steps, 1),
    }


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    n = 400 if full else 40
    rows = [sharing_stats(n, w, beam, seed) for beam in (False, True) for w in WIDTHS]
    rows += [sharing_stats(n, w, False, seed, "recompute") for w in WIDTHS]  # what loses the sharing
    for r in rows:
        r["published_kv_saved"] = PUBLISHED_SAVED[r["mode"]]
    plots = []
    if out is not None:
        plots.append(plot_lines(list(WIDTHS), {
            "parallel sampling": [r["kv_saved"] for r in rows if r["mode"] == "parallel" and r["preemption"] == "swap"],
            "parallel sampling, analytic": [r["analytic_kv_saved"] for r in rows
                                            if r["mode"] == "parallel" and r["preemption"] == "swap"],
            "parallel sampling, recompute preemption": [r["kv_saved"] for r in rows if r["preemption"] == "recompute"],
            "beam search": [r["kv_saved"] for r in rows if r["mode"] == "beam"],
        }, out / "parallel_sampling.png", "samples / beams", "KV blocks saved by sharing",
            "KV saved by block sharing, OPT-13B, ShareGPT-like"))
    par = {r["width"]: r for r in rows if r["mode"] == "parallel" and r["preemption"] == "swap"}
    rec = {r["width"]: r for r in rows if r["preemption"] == "recompute"}

    def pct(by_width: dict, key: str) -> str:
        return "/".join(f"{100 * by_width[w][key]:.1f}" for w in WIDTHS) + "%"

    return ExperimentResult(
        "parallel_sampling", "Parallel sampling and beam search: sharing vs copying", rows,
        {"requests": n}, plots,
        setup=(f"{n} ShareGPT-like requests queued at t=0 on OPT-13B / A100-40GB, {BLOCK}-token blocks. "
               "kv_saved = 1 - blocks in use / blocks private per-sample copies would need, summed over "
               "steps; analytic_kv_saved is the same ratio from the requests' lengths alone (no preemption, "
               "no block rounding). A preempted group is swapped to a host pool as large as the device's, as "
               "vLLM swaps every group of several sequences; the recompute rows recompute it instead. Beam "
               "search is the core's own (the engine's), fed by a seeded stand-in for the model: each beam "
               "offers continuations whose logprobs fall by Exp(1) draws."),
        finding=("Samples of one request share the prompt's blocks; only the partially filled last block "
                 "is copied on the first write, so copy-on-write moves a few blocks per sample where a "
                 f"copying system duplicates the whole prompt. Parallel sampling saves {pct(par, 'kv_saved')} "
                 f"at n = 2/4/6 (analytic {pct(par, 'analytic_kv_saved')}; what is left is preemption and the "
                 "partial blocks). Recomputing a preempted group instead saves only "
                 f"{pct(rec, 'kv_saved')}: each sample then prefills its own copy of the prompt (prefix caching "
                 "is off, as in the paper), so the group shares nothing for the rest of its run, and this "
                 "offline run preempts most groups. Beams share more because they share generated history as well."),
        published=("vLLM SOSP'23 §6.3 / Fig. 15 (OPT-13B): sharing saves 6.1-9.8% of KV memory for parallel "
                   "sampling and 37.6-55.2% for beam search on Alpaca, 16.2-30.5% and 44.3-66.3% on ShareGPT, "
                   "rising with the width. The paper counts the blocks saved by sharing over the blocks without "
                   "sharing, which for a prompt P and n samples of O tokens is (n-1) P / n (P + O) at the end, "
                   "(n-1) P O / n (P O + O^2/2) summed over the decode: with ShareGPT's means (161 / 338 tokens) "
                   "16-27% for n = 2-6, the published range. kvpool's earlier 3.0-5.7% came from recompute "
                   "preemption of the groups (the recompute rows), which vLLM never does to a group of several "
                   "sequences; with swapping kvpool's saving is within the published range at n = 2 and a few "
                   "points under it at n = 4-6, where swapped groups wait on the host while single-sample "
                   "requests run, and a sample's partial last block is its own. Beam search's saving rises with "
                   "the width, as published, and exceeds the ShareGPT range at widths 4-6, probably because the "
                   "stand-in's beams share their history longer than real beams, whose candidates diverge on "
                   "the model's scores."),
    )
