"""Load or recompute: how much of a store hit is worth reading, given what reads and prefills cost.

A store hit past the device hit is a run of blocks, each in some tier. Its KV must be contiguous
from the start, so the only choice is a prefix: load the first k blocks, recompute the rest. The
planner prices every k with the measured costs it is given (each tier's per-read latency and
bandwidth, the bytes of a block, the prefill time of a range) and returns the cheapest; ties go
to the larger k (loading), so with nothing measured (free reads) it loads the whole hit, as
before planning existed. Pure: no clock, no I/O; the engine, the simulator and `kvpool kv calc`
pass their own costs.

`LinearEstimate` is the small online estimate the drivers keep: a linear fit y = a + b x over
the recent measurements (exponentially forgotten), from which a tier's latency and bandwidth
(x = bytes, y = seconds per read) or the engine's prefill cost (x = tokens, y = seconds per
forward) are read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvpool.core.hashing import BlockHash

PrefillCost = Callable[[int, int], float]  # (cached tokens, new tokens) -> seconds to prefill them


@dataclass(slots=True, frozen=True)
class ReadCost:
    """One tier's read cost: a fixed latency per read plus bytes over bandwidth (bytes/s)."""

    latency_s: float
    bandwidth: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(slots=True, frozen=True)
class LoadEstimates:
    """What a plan needs to know: each tier's `read` cost (a tier left out reads for free: not
    measured yet), the stored `block_bytes`, the `prefill_s` of a range, and which tiers' reads
    the driver `overlap`s with computing the rest (layer by layer, under the forward): True for
    every tier, a set for the tiers named there; the others are read before the forward. Those
    reads hide under the group's first forward only: `first_forward_tokens` is how many new
    tokens it computes at most (the token budget of a chunked prefill; None: the whole rest)."""

    read: Mapping[str, ReadCost]
    block_bytes: int
    prefill_s: PrefillCost
    overlap: bool | frozenset[str] = False
    first_forward_tokens: int | None = None

    def overlaps(self, tier: str | None) -> bool:
        """Whether a read from `tier` runs under the forward."""
        if isinstance(self.overlap, bool):
            return self.overlap
        return tier in self.overlap


@dataclass(slots=True, frozen=True)
class LoadPlan:
    """Load the first `blocks` of the hit and recompute the rest; the estimated seconds of the
    chosen plan (`load_s`, `compute_s`, `total_s`), of loading all (`all_load_s`) and of
    recomputing all (`recompute_s`)."""

    blocks: int
    load_s: float
    compute_s: float
    total_s: float
    all_load_s: float
    recompute_s: float


class LoadCosts(Protocol):
    """A driver's side of planning: which tier holds each block of a hit, and the estimates now
    (None: nothing to plan with yet; the hit is loaded whole)."""

    def tiers_of(self, hashes: Sequence[BlockHash]) -> list[str]: ...

    def estimates(self) -> LoadEstimates | None: ...


def plan_load(tiers: Sequence[str | None], est: LoadEstimates, start_tokens: int, prompt_len: int,
              block_size: int) -> LoadPlan:
    """The cheapest k for a hit whose blocks sit in `tiers` (one name per block, in order; None:
    unknown, free) after a device hit of `start_tokens`, for a prompt of `prompt_len` tokens that
    recomputes from `start_tokens + k * block_size` on. A plan costs its reads before the forward,
    the longer of its reads under the forward and the first forward's share of the recompute, and
    the rest of the recompute."""
    if start_tokens + len(tiers) * block_size >= prompt_len:
        raise ValueError(f"a hit of {len(tiers)} blocks from token {start_tokens} reaches past the prompt's "
                         f"{prompt_len} tokens")
    per_read = {name: cost.seconds(est.block_bytes) for name, cost in est.read.items()}
    before, under = [0.0], [0.0]  # the first k blocks' reads before the forward, and under it
    for name in tiers:
        s = per_read.get(name, 0.0) if name is not None else 0.0
        hidden = est.overlaps(name)
        before.append(before[-1] + (0.0 if hidden else s))
        under.append(under[-1] + (s if hidden else 0.0))
    totals = []
    for k in range(len(before)):
        done = start_tokens + k * block_size
        new = prompt_len - done
        compute_s = est.prefill_s(done, new)
        first = new if est.first_forward_tokens is None else min(new, est.first_forward_tokens)
        first_s = compute_s if first == new else est.prefill_s(done, first)
        totals.append((before[k] + max(under[k], first_s) + compute_s - first_s, before[k] + under[k], compute_s))
    best = min(range(len(totals)), key=lambda k: (totals[k][0], -k))
    total, load_s, compute_s = totals[best]
    return LoadPlan(best, load_s, compute_s, total, totals[-1][0], totals[0][0])


def break_even_bandwidth(est: LoadEstimates, tier: str, start_tokens: int, prompt_len: int, block_size: int,
                         blocks: int, low: float = 1e3, high: float = 1e13) -> float | None:
    """The lowest bandwidth of `tier` (bytes/s, keeping its latency) at which the planner loads all
    `blocks` of a hit there; None if it never does below `high`. The plan is monotone in bandwidth,
    so a bisection (in log space) finds it."""
    latency = est.read[tier].latency_s if tier in est.read else 0.0

    def loads_all(bw: float) -> bool:
        trial = replace(est, read={**est.read, tier: ReadCost(latency, bw)})
        return plan_load([tier] * blocks, trial, start_tokens, prompt_len, block_size).blocks == blocks

    if not loads_all(high):
        return None
    if loads_all(low):
        return low
    for _ in range(60):
        mid = (low * high) ** 0.5
        low, high = (low, mid) if loads_all(mid) else (mid, high)
    return high


class LinearEstimate:
    """y = intercept + slope * x over recent (x, y) measurements, each older one weighing
    `1 - alpha` times as much as the next. With one x value seen (every read of one block size)
    the intercept cannot be told from the slope: the line goes through the origin (the whole cost
    is per unit); so does a fit with a negative slope or intercept. Neither is ever negative."""

    __slots__ = ("alpha", "count", "_w", "_x", "_y", "_xx", "_xy")

    def __init__(self, alpha: float = 0.25) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.count = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def update(self, x: float, y: float) -> None:
        keep = 1.0 - self.alpha
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + x
        self._y = keep * self._y + y
        self._xx = keep * self._xx + x * x
        self._xy = keep * self._xy + x * y
        self.count += 1

    def line(self) -> tuple[float, float]:
        """(intercept, slope); (0, 0) before any measurement."""
        if self.count == 0:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > 1e-9 * mx * mx:
            slope = (self._xy / self._w - mx * my) / var
            intercept = my - slope * mx
            if slope > 0 and intercept >= 0:
                return intercept, slope
        # one x seen, or a noisy line (more work cost less, or a negative fixed cost): through the
        # origin, which prices more work higher, never lower (a planner then errs towards loading)
        return 0.0, (my / mx if mx > 0 else 0.0)

    def read_cost(self) -> ReadCost | None:
        """As a tier's read cost (x = bytes, y = seconds per read); None before any read."""
        intercept, slope = self.line()
        if slope <= 0:  # nothing measured, or reads of nothing (0 bytes) that took no time
            return None
        return ReadCost(intercept, 1.0 / slope)
