"""Experiment 2 (vLLM Fig. 13): how many requests each system batches — paged KV under the real
scheduler vs Orca-style contiguous Max / Pow2 / Oracle reservation, on ShareGPT-like and
Alpaca-like loads at the paper's request rates; then the same systems with memory as the only
limit, at three KV budgets, to show the batch grows with memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import ExperimentResult, check_size, roofline
from kvpool.sim.experiments.latency_rate import ContiguousServer, _policy
from kvpool.sim.instance import run_instance
from kvpool.sim.plots import plot_grouped_bars, plot_lines
from kvpool.sim.workloads import SimRequest, WorkloadSpec, get_lengths, synthetic_workload

MAX_LEN = 2048
BLOCK = 16
WORKLOADS = ("sharegpt", "alpaca")
SYSTEMS = ("max", "pow2", "oracle", "paged")
PAPER_RATES = {"sharegpt": 2.0, "alpaca": 30.0}  # vLLM Fig. 13's caption
# vLLM Fig. 13, OPT-13B on A100-40GB: average batched requests at those rates.
PUBLISHED = {"sharegpt": {"max": 7.00, "pow2": 9.81, "oracle": 13.62, "paged": 30.42},
             "alpaca": {"max": 7.00, "pow2": 43.24, "oracle": 72.75, "paged": 132.44}}
MEMORY_SHARES = (0.25, 0.5, 1.0)  # of the A100's KV budget, in the memory-bound runs


def mean_batches(requests: Sequence[SimRequest], num_slots: int, queued_only: bool = False) -> dict[str, float]:
    """Mean requests per iteration of each system on `requests` (at their arrival times).
    `queued_only` averages only over iterations that left requests waiting, where the KV
    memory, not the arrivals, set the batch. Requests ask for up to the model's maximum length,
    as in the paper; max_num_seqs is 256 for every system."""
    cost, _ = roofline("opt-13b", "a100-40gb", block_size=BLOCK)
    out = {}
    for system in SYSTEMS[:3]:
        server = ContiguousServer(num_slots, _policy(system), cost, max_tokens=None)
        server.run(requests)
        out[system] = (server.queued_batched / max(server.queued_steps, 1) if queued_only
                       else server.batched / max(server.steps, 1))
    cfg = SchedulerConfig(num_blocks=num_slots // BLOCK, block_size=BLOCK, max_num_batched_tokens=MAX_LEN,
                          max_model_len=MAX_LEN, enable_prefix_caching=False)
    acc = [0, 0]

    def on_step(inst, now, res) -> None:
        if queued_only and not inst.sched.waiting:
            return
        acc[0] += res.batch_size
        acc[1] += 1

    run_instance(requests, cfg, cost, on_step=on_step)
    out["paged"] = acc[0] / max(acc[1], 1)
    return out


def _chain(batches: dict[str, float]) -> str:
    """'max 7.0 < pow2 9.8 ~ oracle 9.9': systems by batch, '~' within 1%."""
    order = sorted(batches, key=batches.get)
    out = f"{order[0]} {batches[order[0]]:.1f}"
    for prev, k in zip(order, order[1:], strict=False):
        out += f" {'~' if batches[k] <= 1.01 * batches[prev] else '<'} {k} {batches[k]:.1f}"
    return out


def per_token_s(batch: float, workload: str) -> float:
    """Seconds per output token that a mean batch implies at the paper's rate when the system is
    arrival-bound: Little's law (batch = rate x time in system) over the mean output length."""
    return batch / PAPER_RATES[workload] / get_lengths(workload).output_mean


def workload(lengths: str, n: int, rate: float, seed: int) -> list[SimRequest]:
    return synthetic_workload(WorkloadSpec(num_requests=n, rate=rate, lengths=lengths, max_len=MAX_LEN, seed=seed))


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    _, blocks = roofline("opt-13b", "a100-40gb", block_size=BLOCK)
    num_slots = blocks * BLOCK  # OPT-13B's KV budget on the A100-40GB, not rounded
    n = {"sharegpt": 1000, "alpaca": 4000} if full else {"sharegpt": 200, "alpaca": 600}
    at_rate = {w: mean_batches(workload(w, n[w], PAPER_RATES[w], seed), num_slots) for w in WORKLOADS}
    rows = []
    for w in WORKLOADS:
        for s in SYSTEMS:
            rows.append({"setup": f"{PAPER_RATES[w]:g} req/s", "workload": w, "system": s, "kv_slots": num_slots,
                         "mean_batch": at_rate[w][s], "published": PUBLISHED[w][s]})
    bound: dict[str, dict[float, dict[str, float]]] = {}
    m = {"sharegpt": 300, "alpaca": 1000} if full else {"sharegpt": 120, "alpaca": 400}
    for w in WORKLOADS:
        reqs = [replace(r, arrival_s=0.0) for r in workload(w, m[w], 1.0, seed)]
        bound[w] = {}
        for share in MEMORY_SHARES:
            slots = int(num_slots * share) // BLOCK * BLOCK
            bound[w][share] = mean_batches(reqs, slots, queued_only=True)
            for s in SYSTEMS:
                rows.append({"setup": "memory-bound", "workload": w, "system": s, "kv_slots": slots,
                             "mean_batch": bound[w][share][s], "published": None})
    plots = []
    if out is not None:
        plots.append(plot_grouped_bars(list(WORKLOADS), {s: [at_rate[w][s] for w in WORKLOADS] for s in SYSTEMS},
                                       out / "concurrency.png", "mean batched requests",
                                       "Mean batch at the paper's rates, OPT-13B on A100-40GB"))
        plots.append(plot_lines([int(num_slots * f) for f in MEMORY_SHARES],
                                {f"{w} {s}": [bound[w][f][s] for f in MEMORY_SHARES] for w in WORKLOADS
                                 for s in ("oracle", "paged")},
                                out / "concurrency_memory.png", "KV slots", "mean batch while requests wait",
                                "Memory-bound batch vs KV memory", logy=True))
    return ExperimentResult(
        "concurrency", "Concurrency (vLLM Fig. 13): mean batched requests, paged vs contiguous", rows,
        {"num_slots": num_slots, "requests": n, "rates_rps": PAPER_RATES, "memory_bound_requests": m,
         "memory_shares": list(MEMORY_SHARES)}, plots,
        setup=(f"OPT-13B on one A100-40GB: {num_slots} KV slots (the memory left after the weights at 90% "
               f"utilisation, the whole budget: the buddy arena is tiled, not rounded down); max length {MAX_LEN}, "
               "every request may generate up to it. Contiguous systems are Orca-style FCFS iteration-level "
               "schedulers on a buddy allocator, reserving 2048 slots (Max), prompt + output rounded up to a "
               "power of two (Pow2: at most 2x the output), or exactly prompt + output (Oracle); the paged system "
               f"is the real scheduler with {BLOCK}-token blocks. First at the paper's rates ({n['sharegpt']} "
               f"ShareGPT-like requests at {PAPER_RATES['sharegpt']:g} req/s, {n['alpaca']} Alpaca-like at "
               f"{PAPER_RATES['alpaca']:g} req/s), averaged over every iteration. Then memory-bound: "
               f"{m['sharegpt']} / {m['alpaca']} requests queued at t=0 on {', '.join(f'{f:.0%}' for f in MEMORY_SHARES)} "
               "of the budget, averaged over the iterations that left requests waiting (so neither arrivals nor "
               "the drain at the end set the number)."),
        finding=("At the paper's rates: " + "; ".join(f"{w} {_chain(at_rate[w])}" for w in WORKLOADS)
                 + ". Max fits floor(slots / 2048) = 7 requests whatever the workload "
                 "(the paper's 7.00). A system whose batch is well below its memory-bound value at the full "
                 "budget (second part of the table) is arrival-bound: it batches what has arrived (Little's law, "
                 "rate x time in system), and such systems tie; here that is paged on ShareGPT and Oracle and "
                 "paged on Alpaca, while Max and Pow2 (and Oracle on ShareGPT) are memory-bound and lose to "
                 "their reservations, buddy round-up and external fragmentation. By Little's law the paper's "
                 "paged batches imply " + " and ".join(
                     f"{per_token_s(PUBLISHED[w]['paged'], w) * 1e3:.0f} ms per output token on {w}" for w in WORKLOADS)
                 + " against the roofline's " + " and ".join(
                     f"{per_token_s(at_rate[w]['paged'], w) * 1e3:.0f} ms" for w in WORKLOADS)
                 + ": requests stay longer in the paper's system, so more of them are batched and memory binds "
                 "sooner there. With memory as the only limit every system's batch grows with "
                 "the KV memory, roughly in proportion, in the paper's order, paged about 3x the Oracle "
                 "(Alpaca's paged batch nears max_num_seqs=256 at the full budget)."),
        published=("vLLM SOSP'23 Fig. 13 (OPT-13B, A100-40GB; ShareGPT at 2 req/s, Alpaca at 30 req/s): Orca "
                   "(Max) 7.00 / 7.00, (Pow2) 9.81 / 43.24, (Oracle) 13.62 / 72.75, vLLM 30.42 / 132.44 batched "
                   "requests (published column). Max and Pow2 match within a few percent (the paper's definitions "
                   "and rates, the whole KV budget). Oracle and paged remain below the paper's: not a modelling "
                   "error in the schedulers but the step time. The roofline step (weights and KV over 70% of HBM "
                   "bandwidth plus 2 ms) is shorter than the paper's measured iterations, which also carry vLLM "
                   "0.1's per-step Python overhead and its prompt-only steps (a step runs either prompts or "
                   "decodes, so decodes wait while prompts run; kvpool mixes them); at the same rate fewer "
                   "requests are then in the system, and the systems that are not memory-bound (paged on both, "
                   "Oracle on Alpaca) batch what has arrived."),
        columns=["setup", "workload", "system", "kv_slots", "mean_batch", "published"],
    )
