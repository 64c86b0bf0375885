"""Preemption: when a running group needs a block and none is free, the latest-arrived running
group gives its blocks up whole, swapped out to host memory or dropped to be recomputed, so the
oldest group always progresses. A part of `Scheduler` (a mixin over its state)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.fit import largest_fitting
from kvpool.sched.output import SchedulerOutput
from kvpool.sched.request import SeqStatus, Sequence, SequenceGroup

if TYPE_CHECKING:
    from kvpool.sched.scheduler import SchedulerConfig


class Preemption:
    """`Scheduler`'s preemption steps; they read and change the scheduler's queues."""

    config: SchedulerConfig
    kv: KVCacheManager
    running: list[SequenceGroup]
    waiting: deque[SequenceGroup]
    swapped: deque[SequenceGroup]
    num_preemptions: int
    num_swapped_blocks: int

    def _reserve_decode_slots(
        self, group: SequenceGroup, live: list[Sequence], out: SchedulerOutput, may_preempt: bool = True,
        wanted: list[int] | None = None,
    ) -> bool:
        """Give every live sequence of `group` a slot for its newest token, and its window groups
        the blocks of the prefill chunk it computes now (`wanted[i]` tokens of `live[i]`; a
        chunk shrinks, in `wanted`, to what fits before anyone is preempted), preempting the
        latest-arrived running groups while blocks are short. False when `group` itself was
        preempted, or when blocks are short and preempting is not allowed."""
        kv = self.kv
        entry = kv.seq
        extras, chunks = [], []
        for i, s in enumerate(live):
            n = len(s.token_ids) - entry(s.seq_id).num_tokens
            if n:
                extras.append((s.seq_id, n))
            elif (kv.windowed and wanted is not None and wanted[i]  # a prefill chunk
                  and kv.window_blocks_needed(s.seq_id, s.num_computed_tokens + wanted[i])):
                chunks.append((i, s))
        asked = [(i, wanted[i]) for i, _ in chunks]
        while extras or chunks:
            for i, tokens in asked:  # each try starts from the chunks asked for: a preemption frees blocks
                wanted[i] = tokens
            need = sum(kv.append_blocks_needed(sid, n) for sid, n in extras)
            free = kv.num_free_blocks - need
            if self._fit_chunks(chunks, wanted, free):
                break
            if not may_preempt:
                return False
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is group:
                return False
        for sid, n in extras:
            out.copies.extend(kv.append_slots(sid, n))
        for i, s in chunks:
            kv.reserve(s.seq_id, s.num_computed_tokens + wanted[i])
        return True

    def _fit_chunks(self, chunks: list[tuple[int, Sequence]], wanted: list[int] | None, free: int) -> bool:
        """Shrink the prefill chunks (`wanted[i]` tokens of each chunk's sequence), the last one
        first and none below one token, until their window groups' blocks fit `free`."""
        kv = self.kv

        def need() -> int:
            return sum(kv.window_blocks_needed(s.seq_id, s.num_computed_tokens + wanted[i]) for i, s in chunks)

        if need() <= free:
            return True
        assert wanted is not None
        for i, _ in reversed(chunks):

            def fits(tokens: int, i: int = i) -> bool:
                wanted[i] = tokens
                return need() <= free

            best = largest_fitting(fits, wanted[i])
            wanted[i] = max(best, 1)
            if best:
                return True  # else even one token of this chunk is too many: shrink the next one too
        return False

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        group.num_preemptions += 1
        out.preempted.append(group)
        seq_ids = [s.seq_id for s in group.live_seqs]
        loading = bool(group.pending_kv_loads)  # its blocks are not filled yet: drop them, never swap
        group.pending_kv_loads.clear()
        if not loading and self.config.preemption_mode == "swap" and self.kv.can_swap_out(seq_ids):
            out.swap_out.extend(self.kv.swap_out(seq_ids))
            self.num_swapped_blocks += len(out.swap_out)
            for s in group.live_seqs:
                s.status = SeqStatus.SWAPPED
            self.swapped.append(group)
            return
        for s in group.live_seqs:
            self.kv.free(s.seq_id)
            s.num_computed_tokens = 0
            s.status = SeqStatus.WAITING
        self.waiting.appendleft(group)
