"""One decode instance's load as the conductor sees it, now and at a future time.

Requests the conductor admitted are tracked by their predicted decode interval
[start, finish): start is when their prefill is predicted (then known) to finish, finish is
start + max_tokens x predicted TBT. Each interval carries its own context tokens and KV
blocks, so the load at time T sums exactly the requests alive then (not an average over
every tracked request, which a single long prompt would inflate for all the others).
Requests the instance reports but the conductor does not track ("untracked", e.g. admitted
before a restart) are assumed to keep running.

Intervals are kept in two lists sorted by start and by finish. The requests alive at T are
all of them minus those starting after T and those finishing by T; both are short runs at
the lists' ends when T is near now (finished requests leave the lists), so a query sums few
entries.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass
from operator import itemgetter

from kvpool.conductor.predictor import StepTimePredictor
from kvpool.conductor.records import InstanceLoad

_time = itemgetter(0)
Interval = tuple[float, int, int]  # (start or finish time, context tokens, KV blocks)


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """Requests decoding on an instance at some time, with their total context and KV blocks."""

    requests: int = 0
    context_tokens: float = 0.0
    kv_blocks: float = 0.0


class DecodeView:
    __slots__ = ("_starts", "_finishes", "_ctx_sum", "_blocks_sum", "in_decode", "report", "_untracked")

    def __init__(self) -> None:
        self._starts: list[Interval] = []
        self._finishes: list[Interval] = []
        self._ctx_sum = 0
        self._blocks_sum = 0
        self.in_decode = 0
        self.report = InstanceLoad()
        self._untracked = 0

    def on_report(self, load: InstanceLoad) -> None:
        """A report counts every tracked request already in decode; the rest are untracked."""
        self.report = load
        self._untracked = max(0, load.running_decode_reqs - self.in_decode)

    def add(self, start: float, finish: float, ctx: int, blocks: int) -> None:
        insort(self._starts, (start, ctx, blocks))
        insort(self._finishes, (finish, ctx, blocks))
        self._ctx_sum += ctx
        self._blocks_sum += blocks

    def remove(self, start: float, finish: float, ctx: int, blocks: int, in_decode: bool) -> None:
        _delete(self._starts, (start, ctx, blocks))
        _delete(self._finishes, (finish, ctx, blocks))
        self._ctx_sum -= ctx
        self._blocks_sum -= blocks
        if in_decode:
            self.in_decode -= 1

    def start_decode(self, old: tuple[float, float], new: tuple[float, float], ctx: int, blocks: int) -> None:
        """A tracked request's prefill finished: replace its predicted interval."""
        _delete(self._starts, (old[0], ctx, blocks))
        _delete(self._finishes, (old[1], ctx, blocks))
        insort(self._starts, (new[0], ctx, blocks))
        insort(self._finishes, (new[1], ctx, blocks))
        self.in_decode += 1

    @property
    def tracked(self) -> int:
        return len(self._starts)

    @property
    def untracked(self) -> int:
        return self._untracked

    def committed(self) -> DecodeLoad:
        """Every request running on or promised to this instance: a tracked request counts
        until the driver reports it done, whatever its predicted finish."""
        return self._plus_untracked(self.tracked, self._ctx_sum, self._blocks_sum)

    def load_at(self, t: float) -> DecodeLoad:
        """Requests predicted to be decoding on this instance at time `t`."""
        return self._alive(t, t)

    def _alive(self, started_by: float, t: float) -> DecodeLoad:
        """Tracked requests predicted to start by `started_by` and not to finish by `t`,
        plus the untracked ones."""
        not_started = self._starts[bisect_right(self._starts, started_by, key=_time):]
        finished = self._finishes[: bisect_right(self._finishes, t, key=_time)]
        out = not_started + finished
        return self._plus_untracked(self.tracked - len(out), self._ctx_sum - sum(c for _, c, _ in out),
                                    self._blocks_sum - sum(b for _, _, b in out))

    def _plus_untracked(self, n: int, ctx: int, blocks: int) -> DecodeLoad:
        """`n` tracked requests holding `ctx` context tokens and `blocks` KV blocks, plus the
        untracked ones' share of what the instance reports."""
        share = self._untracked_share()
        return DecodeLoad(
            requests=self._untracked + n,
            context_tokens=self.report.decode_context_tokens * share + ctx,
            kv_blocks=(self.report.total_kv_blocks - self.report.free_kv_blocks) * share + blocks,
        )

    def peak(self, start: float, end: float) -> DecodeLoad:
        """The most requests, context tokens and KV blocks predicted at any moment of
        [start, end), each its own maximum (so an upper bound on each). A request decoding
        over [start, end) meets every request alive then, including those admitted earlier
        whose prefill ends after `start`."""
        first = self.load_at(start)
        n, ctx, blocks = first.requests, first.context_tokens, first.kv_blocks
        top = [n, ctx, blocks]
        events = [(t, 0, -1, -c, -b) for t, c, b in _between(self._finishes, start, end)]
        events += [(t, 1, 1, c, b) for t, c, b in _between(self._starts, start, end)]
        for _, _, dn, dc, db in sorted(events):  # at equal times a finish goes first
            n, ctx, blocks = n + dn, ctx + dc, blocks + db
            top = [max(top[0], n), max(top[1], ctx), max(top[2], blocks)]
        return DecodeLoad(*top)

    def _untracked_share(self) -> float:
        """The untracked requests' share of what the instance reports running (0 when none
        runs: blocks held then belong to tracked requests, or are cached and evictable)."""
        running = self.report.running_decode_reqs
        return self._untracked / running if running else 0.0


@dataclass(frozen=True, slots=True)
class DecodeFit:
    """Whether a request fits on one decode instance: `tbt` predicted at the load checked,
    `interval_tbt` the TBT that sets the request's predicted decode interval."""

    fits: bool
    tbt: float
    interval_tbt: float
    requests: int


def decode_fit(view: DecodeView, predictor: StepTimePredictor, rejection: str, tbt_slo_s: float | None,
               ctx: int, blocks: int, max_tokens: int, at: float) -> DecodeFit:
    """Whether a request (`ctx` context tokens, `blocks` KV blocks) fits on `view`'s instance.
    "none" and "early" check the load now, promised requests included; "predictive" checks the
    most load predicted at any moment while the request decodes (from its predicted prefill
    end `at`, max_tokens steps at the TBT predicted then), so it also keeps the room promised
    to requests admitted earlier whose prefill ends after `at`."""
    step = predictor.decode_step_time
    if rejection == "predictive":
        first = view.load_at(at)
        interval_tbt = step(first.requests + 1, int(first.context_tokens + ctx))
        load = view.peak(at, at + max_tokens * interval_tbt)
        tbt = step(load.requests + 1, int(load.context_tokens + ctx))
    else:
        load = view.committed()
        tbt = interval_tbt = step(load.requests + 1, int(load.context_tokens + ctx))
    total = view.report.total_kv_blocks
    fits = (tbt_slo_s is None or tbt <= tbt_slo_s) and not (total and load.kv_blocks + blocks > total)
    return DecodeFit(fits, tbt, interval_tbt, load.requests)


def _delete(intervals: list[Interval], item: Interval) -> None:
    del intervals[bisect_left(intervals, item)]


def _between(intervals: list[Interval], start: float, end: float) -> list[Interval]:
    """The entries with a time in (start, end)."""
    return intervals[bisect_right(intervals, start, key=_time) : bisect_left(intervals, end, key=_time)]
