"""Where every request is: the scheduler's queues and its requests by id, shared by its parts."""

from __future__ import annotations

from collections import deque

from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.request import SequenceGroup


class Queues:
    """Waiting groups (FCFS), running groups (oldest first), swapped-out groups (oldest first),
    and every queued request by id. A group is in exactly one queue until it is released."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.groups: dict[str, SequenceGroup] = {}

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def release(self, group: SequenceGroup) -> None:
        """Free every block of `group` and forget it."""
        kv = self.kv
        for seq in group.seqs:
            if kv.has_seq(seq.seq_id):
                kv.free(seq.seq_id)
        self.groups.pop(group.request_id, None)
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)

    def free_finished(self) -> list[SequenceGroup]:
        """Remove and return the running groups whose every sequence has finished."""
        done = [g for g in self.running if g.is_finished]
        for g in done:
            self.release(g)
        return done

