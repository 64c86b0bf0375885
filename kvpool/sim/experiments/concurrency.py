"""Experiment 2: how many requests each system batches — paged KV under the real scheduler vs
contiguous Max / Pow2 / Oracle reservation, on ShareGPT-like and Alpaca-like loads."""

from __future__ import annotations

from pathlib import Path

from kvpool.core.contiguous import MaxPolicy, OraclePolicy, Pow2Policy
from kvpool.sim.experiments.base import ExperimentResult, check_size, roofline
from kvpool.sim.experiments.memory_waste import BLOCK, MAX_LEN, MAX_TOKENS, paged_fractions
from kvpool.sim.plots import plot_grouped_bars
from kvpool.sim.waste import replay_contiguous
from kvpool.sim.workloads import WorkloadSpec, synthetic_workload

WORKLOADS = ("sharegpt", "alpaca")
SYSTEMS = ("max", "pow2", "oracle", "paged")


def mean_batches(lengths: str, num_requests: int, num_slots: int, seed: int) -> dict[str, float]:
    """Mean requests per iteration of each system on one overloaded workload (all at t=0)."""
    reqs = synthetic_workload(WorkloadSpec(num_requests=num_requests, rate=float("inf"), lengths=lengths,
                                           max_len=MAX_LEN, seed=seed))
    out = {}
    for policy in (MaxPolicy(MAX_LEN), Pow2Policy(), OraclePolicy()):
        out[policy.name] = replay_contiguous(reqs, num_slots, policy, max_len=MAX_LEN,
                                             max_tokens=MAX_TOKENS).mean_batch
    out["paged"] = paged_fractions(reqs, num_slots)[1]
    return out


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    _, blocks = roofline("opt-13b", "a100-40gb", block_size=BLOCK)
    num_slots = 1 << (blocks * BLOCK).bit_length() - 1  # same arena as the memory-waste experiment
    n = 2000 if full else 300
    batches = {w: mean_batches(w, n, num_slots, seed) for w in WORKLOADS}
    rows = [{"workload": w, **{s: batches[w][s] for s in SYSTEMS},
             "paged_over_oracle": batches[w]["paged"] / batches[w]["oracle"]} for w in WORKLOADS]
    plots = []
    if out is not None:
        plots.append(plot_grouped_bars(list(WORKLOADS), {s: [batches[w][s] for w in WORKLOADS] for s in SYSTEMS},
                                       out / "concurrency.png", "mean batched requests",
                                       "Mean batch, OPT-13B on A100-40GB"))
    return ExperimentResult(
        "concurrency", "Concurrency: mean batched requests, paged vs contiguous", rows,
        {"num_slots": num_slots, "requests": n, "max_tokens": MAX_TOKENS}, plots,
        setup=(f"OPT-13B on one A100-40GB ({num_slots} KV slots); {n} requests of each workload queued at "
               f"t=0 so memory is the only limit; max length {MAX_LEN}, each request asks for up to "
               f"{MAX_TOKENS} tokens (what Pow2 sizes for). Contiguous systems admit FCFS while the head "
               "request's reservation fits; the paged system is the real scheduler with 16-token blocks. "
               "The number is the mean count of requests in an iteration."),
        finding=("Paged KV batches more requests than any reservation scheme: about twice the Oracle that "
                 "knows each output length, and 4-18x Max, because it holds only the tokens that exist. "
                 "Against Max and Pow2 the gap is widest on short Alpaca-like requests, whose fixed or "
                 "rounded-up reservation is mostly empty; the Oracle still loses to buddy rounding and "
                 "external fragmentation."),
        columns=["workload", *SYSTEMS, "paged_over_oracle"],
    )
