"""One decode instance's load as the conductor sees it, now and at a future time.

Requests the conductor admitted are tracked by their predicted decode interval
[start, finish): start is when their prefill is predicted (then known) to finish, finish is
start + max_tokens x predicted TBT. Requests the instance reports but the conductor does not
track ("untracked", e.g. admitted before a restart) are assumed to keep running. Counting
intervals alive at time T is two bisections over sorted start and finish times.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

from kvpool.cluster.records import InstanceLoad


class DecodeView:
    __slots__ = (
        "_starts",
        "_finishes",
        "_ctx_sum",
        "_blocks_sum",
        "in_decode",
        "report",
        "_untracked",
    )

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._finishes: list[float] = []
        self._ctx_sum = 0.0
        self._blocks_sum = 0
        self.in_decode = 0
        self.report = InstanceLoad()
        self._untracked = 0

    def on_report(self, load: InstanceLoad) -> None:
        """A report counts every tracked request already in decode; the rest are untracked."""
        self.report = load
        self._untracked = max(0, load.running_decode_reqs - self.in_decode)

    def add(self, start: float, finish: float, ctx: float, blocks: int) -> None:
        insort(self._starts, start)
        insort(self._finishes, finish)
        self._ctx_sum += ctx
        self._blocks_sum += blocks

    def remove(self, start: float, finish: float, ctx: float, blocks: int, in_decode: bool) -> None:
        del self._starts[bisect_left(self._starts, start)]
        del self._finishes[bisect_left(self._finishes, finish)]
        self._ctx_sum -= ctx
        self._blocks_sum -= blocks
        if in_decode:
            self.in_decode -= 1

    def start_decode(self, old: tuple[float, float], new: tuple[float, float]) -> None:
        """A tracked request's prefill finished: replace its predicted interval."""
        del self._starts[bisect_left(self._starts, old[0])]
        del self._finishes[bisect_left(self._finishes, old[1])]
        insort(self._starts, new[0])
        insort(self._finishes, new[1])
        self.in_decode += 1

    @property
    def tracked(self) -> int:
        return len(self._starts)

    def committed(self, now: float) -> int:
        """Requests running or promised to this instance, not predicted finished by `now`."""
        return self._untracked + len(self._finishes) - bisect_right(self._finishes, now)

    def load_at(self, t: float) -> int:
        """Requests predicted to be decoding on this instance at time `t`."""
        started = bisect_right(self._starts, t)
        finished = bisect_right(self._finishes, t)
        return self._untracked + started - finished

    def _untracked_share(self) -> float:
        running = self.report.running_decode_reqs
        return self._untracked / running if running else 0.0

    def context_tokens(self, tracked_load: int) -> float:
        """Total context of `tracked_load` tracked requests plus the untracked ones."""
        avg = self._ctx_sum / self.tracked if self.tracked else 0.0
        return self.report.decode_context_tokens * self._untracked_share() + tracked_load * avg

    def kv_blocks(self, tracked_load: int) -> float:
        """KV blocks held by `tracked_load` tracked requests plus the untracked ones."""
        avg = self._blocks_sum / self.tracked if self.tracked else 0.0
        used = self.report.total_kv_blocks - self.report.free_kv_blocks
        untracked = used * self._untracked_share() if self.report.running_decode_reqs else used
        return untracked + tracked_load * avg

    @property
    def untracked(self) -> int:
        return self._untracked
