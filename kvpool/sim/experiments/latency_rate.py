"""Experiment 3: normalized latency (end-to-end / output tokens) vs request rate for paged KV
and the contiguous Max / Pow2 / Oracle baselines, and the highest rate each sustains under a
normalized-latency SLO (binary search).

The paged system is the real scheduler. The contiguous systems have no scheduler in kvpool,
so `ContiguousServer` below is the baseline: Orca-style FCFS iteration-level batching over
`ContiguousKVManager` — a request is admitted when its reservation fits, its whole prompt
runs in its first iteration, and it holds its region until it finishes. Both pay step times
from the same roofline cost model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpool.core.contiguous import (
    ContiguousKVManager,
    MaxPolicy,
    OraclePolicy,
    Pow2Policy,
    ReservationPolicy,
)
from kvpool.costs.cost_model import CostModel, StepBatch
from kvpool.errors import ConfigError
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import ExperimentResult, check_size, roofline
from kvpool.sim.instance import run_instance
from kvpool.sim.metrics import RequestMetrics
from kvpool.sim.plots import plot_lines
from kvpool.sim.workloads import SimRequest, WorkloadSpec, synthetic_workload

MAX_LEN = 2048
MAX_TOKENS = 512
BLOCK = 16
MAX_BATCHED_TOKENS = 2048
SLO_S = 0.1  # mean normalized latency bound, s per output token (~3x the unloaded latency)
RATES = {"sharegpt": (0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0), "alpaca": (5.0, 10.0, 20.0, 30.0, 40.0, 60.0)}
ALPACA_SCALE = 4  # Alpaca requests are short: four times as many make a comparable load
SYSTEMS = ("max", "pow2", "oracle", "paged")


@dataclass(slots=True)
class _Running:
    req: SimRequest
    metrics: RequestMetrics
    generated: int = 0


class ContiguousServer:
    """FCFS iteration-level batching over one contiguous reservation per request."""

    def __init__(self, num_slots: int, policy: ReservationPolicy, cost: CostModel,
                 max_batch: int = 256, max_batched_tokens: int = MAX_BATCHED_TOKENS) -> None:
        self.kv = ContiguousKVManager(num_slots, policy)
        self.cost, self.max_batch, self.max_batched_tokens = cost, max_batch, max_batched_tokens

    @staticmethod
    def _limits(r: SimRequest) -> tuple[int, int, int]:
        own_max = min(MAX_LEN, r.prompt_len + MAX_TOKENS)
        return r.prompt_len, own_max, min(r.prompt_len + r.output_len, own_max)

    def run(self, requests: Sequence[SimRequest]) -> list[RequestMetrics]:
        pending = sorted(requests, key=lambda r: r.arrival_s)
        pending.reverse()  # pop() takes the earliest
        waiting: deque[SimRequest] = deque()
        running: dict[str, _Running] = {}
        metrics: list[RequestMetrics] = []
        now = 0.0
        while pending or waiting or running:
            while pending and pending[-1].arrival_s <= now:
                waiting.append(pending.pop())
            if not waiting and not running:
                now = pending[-1].arrival_s
                continue
            new_tokens, ctx = [], []
            for st in running.values():
                new_tokens.append(1)
                ctx.append(st.req.prompt_len + st.generated + 1)
            admitted = self._admit(waiting, running, metrics)
            for st in admitted:
                new_tokens.append(st.req.prompt_len)
                ctx.append(st.req.prompt_len)
            if not new_tokens:
                raise ConfigError(f"{waiting[0].request_id} can never fit in {self.kv.arena.num_slots} slots")
            now += self.cost.step_time(StepBatch(new_tokens, ctx))
            for rid in list(running):
                st = running[rid]
                st.metrics.on_token(now)
                st.generated += 1
                if st.generated < self._limits(st.req)[2] - st.req.prompt_len:
                    self.kv.append(rid)
                else:
                    st.metrics.finish(now)
                    self.kv.free(rid)
                    del running[rid]
        return metrics

    def _admit(self, waiting: deque[SimRequest], running: dict[str, _Running],
               metrics: list[RequestMetrics]) -> list[_Running]:
        admitted: list[_Running] = []
        budget = self.max_batched_tokens - len(running)
        while (waiting and len(running) < self.max_batch and waiting[0].prompt_len <= budget
               and self.kv.can_admit(*self._limits(waiting[0]))):
            r = waiting.popleft()
            self.kv.admit(r.request_id, *self._limits(r))
            st = _Running(r, RequestMetrics(r.request_id, r.arrival_s, r.prompt_len))
            metrics.append(st.metrics)
            running[r.request_id] = st
            admitted.append(st)
            budget -= r.prompt_len
        return admitted


def _policy(system: str) -> ReservationPolicy:
    return {"max": MaxPolicy(MAX_LEN), "pow2": Pow2Policy(), "oracle": OraclePolicy()}[system]


def mean_normalized_latency(system: str, requests: Sequence[SimRequest], num_slots: int, cost: CostModel) -> float:
    if system == "paged":
        cfg = SchedulerConfig(num_blocks=num_slots // BLOCK, block_size=BLOCK, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                              max_model_len=MAX_LEN, enable_prefix_caching=False)
        ms = run_instance(requests, cfg, cost).metrics
    else:
        ms = ContiguousServer(num_slots, _policy(system), cost).run(requests)
    return sum(m.normalized_latency for m in ms) / len(ms)


def max_rate_under_slo(latency_at: Callable[[float], float], lo: float, hi: float, iters: int) -> float:
    """Highest rate in [lo, 8 * hi] whose latency meets the SLO, assuming latency grows with
    rate; 0 when even `lo` misses it. A finite workload's latency is bounded even when all of
    it arrives at once, so the search stops at 8 * hi."""
    if latency_at(lo) > SLO_S:
        return 0.0
    for _ in range(3):
        if latency_at(hi) > SLO_S:
            break
        lo, hi = hi, hi * 2
    else:
        return hi
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if latency_at(mid) <= SLO_S else (lo, mid)
    return lo


def workload(lengths: str, n: int, rate: float, seed: int) -> list[SimRequest]:
    return synthetic_workload(WorkloadSpec(num_requests=n, rate=rate, lengths=lengths, max_len=MAX_LEN, seed=seed))


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    cost, blocks = roofline("opt-13b", "a100-40gb", block_size=BLOCK)
    num_slots = 1 << (blocks * BLOCK).bit_length() - 1  # the buddy arena needs a power of two
    n, iters = (1000, 8) if full else (150, 4)
    rows, curves, plots = [], {}, []
    for lengths, rates in RATES.items():
        curves[lengths] = {}
        for system in SYSTEMS:
            count = n * (ALPACA_SCALE if lengths == "alpaca" else 1)
            lat = [mean_normalized_latency(system, workload(lengths, count, r, seed), num_slots, cost) for r in rates]
            curves[lengths][system] = lat
            best = max_rate_under_slo(
                lambda r, s=system, w=lengths, c=count: mean_normalized_latency(s, workload(w, c, r, seed), num_slots, cost),
                rates[0] / 4, rates[-1], iters)
            rows.append({"workload": lengths, "system": system, "max_rate_rps": best,
                         "latency_at_lowest_rate_s": lat[0], "latency_at_highest_rate_s": lat[-1]})
        if out is not None:
            plots.append(plot_lines(list(rates), curves[lengths], out / f"latency_rate_{lengths}.png",
                                    "request rate (req/s)", "mean normalized latency (s/token)",
                                    f"Normalized latency vs rate, OPT-13B, {lengths}-like", logy=True))
    return ExperimentResult(
        "latency_rate", "Latency vs request rate: paged vs contiguous reservation", rows,
        {"requests": n, "num_slots": num_slots, "slo_s_per_token": SLO_S, "rates": RATES, "curves": curves},
        plots,
        setup=(f"OPT-13B on one A100-40GB with {num_slots} KV slots for every system; {n} ShareGPT-like or "
               f"{n * ALPACA_SCALE} Alpaca-like Poisson requests per point, max length {MAX_LEN}, up to {MAX_TOKENS} output tokens "
               f"asked. Paged = the real scheduler ({BLOCK}-token blocks, chunked prefill); the contiguous "
               "baselines are an Orca-style FCFS iteration-level scheduler over the buddy-allocated "
               f"reservation. max_rate_rps: highest rate whose mean normalized latency stays under {SLO_S:g} "
               f"s/token, by bisection ({iters} steps) in [lowest rate / 4, 8 x highest rate] (a value at the "
               "upper end means the SLO held at every rate tried)."),
        finding=("Every system's latency is flat until its batch is capped by memory, then queueing makes it "
                 "climb steeply. Paged KV keeps more requests in flight at the same memory, so it sustains "
                 "the highest rate; Max is capped first, then Pow2, then Oracle, in the order of how much "
                 "they reserve."),
    )
