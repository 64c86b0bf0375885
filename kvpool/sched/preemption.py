"""Preemption: when a running group needs a block and none is free, the latest-arrived running
group gives its blocks up whole, swapped out to host memory or dropped to be recomputed, so the
oldest group always progresses; and a swapped group comes back in when its blocks fit."""

from __future__ import annotations

from kvpool.core.fit import largest_fitting
from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.output import SchedulerOutput
from kvpool.sched.queues import Queues
from kvpool.sched.request import SeqStatus, Sequence, SequenceGroup


class Preemption:
    """Slot reservations for the groups that run, the preemptions they force, and swap-ins."""

    def __init__(self, kv: KVCacheManager, queues: Queues, preemption_mode: str, watermark_blocks: int) -> None:
        self.kv = kv
        self.queues = queues
        self.swap = preemption_mode == "swap"
        self.watermark_blocks = watermark_blocks
        self.num_preemptions = 0
        self.num_swapped_blocks = 0

    def reserve_decode_slots(
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
        running = self.queues.running
        while extras or chunks:
            for i, tokens in asked:  # each try starts from the chunks asked for: a preemption frees blocks
                wanted[i] = tokens
            need = sum(kv.append_blocks_needed(sid, n) for sid, n in extras)
            free = kv.num_free_blocks - need
            if self.fit_chunks(chunks, wanted, free):
                break
            if not may_preempt:
                return False
            victim = running.pop()
            self.preempt(victim, out)
            if victim is group:
                return False
        for sid, n in extras:
            out.copies.extend(kv.append_slots(sid, n))
        for i, s in chunks:
            kv.reserve(s.seq_id, s.num_computed_tokens + wanted[i])
        return True

    def fit_chunks(self, chunks: list[tuple[int, Sequence]], wanted: list[int] | None, free: int) -> bool:
        """Shrink the prefill chunks (`wanted[i]` tokens of each chunk's sequence), the last one
        first and none below one token, until their window groups' blocks fit `free`."""
        kv = self.kv

        def need() -> int:
            return sum(kv.window_blocks_needed(s.seq_id, s.num_computed_tokens + wanted[i]) for i, s in chunks)

        if need() <= free:
            return True
        for i, _ in reversed(chunks):
            assert wanted is not None  # a chunk is some wanted[i]

            def fits(tokens: int, i: int = i) -> bool:
                wanted[i] = tokens
                return need() <= free

            best = largest_fitting(fits, wanted[i])
            wanted[i] = max(best, 1)
            if best:
                return True  # else even one token of this chunk is too many: shrink the next one too
        return False

    def swap_in(self, group: SequenceGroup, live: list[Sequence], wanted: list[int], out: SchedulerOutput) -> bool:
        """Bring the oldest swapped group back in to run `wanted[i]` tokens of `live[i]` when its
        blocks fit above the watermark, with room for each sequence's next token (at most one
        block per group: a new one or a CoW copy) and its window groups' prefill chunk (which
        shrinks to what fits); False when they do not."""
        kv = self.kv
        seq_ids = [s.seq_id for s in live]
        need_blocks = kv.num_swap_in_blocks(seq_ids) + len(seq_ids) * kv.num_groups
        free = kv.num_free_blocks - self.watermark_blocks - need_blocks
        if free < 0 or (kv.windowed and not self.fit_chunks(
                [(i, s) for i, s in enumerate(live) if wanted[i]], wanted, free)):
            return False
        self.queues.swapped.popleft()
        out.swap_in.extend(kv.swap_in(seq_ids))
        self.num_swapped_blocks += len(out.swap_in)
        for seq in live:
            seq.status = SeqStatus.RUNNING
        self.queues.running.append(group)
        reserved = self.reserve_decode_slots(group, live, out, may_preempt=False, wanted=wanted)
        assert reserved, "swap-in admitted a group whose next tokens do not fit"
        return True

    def preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Take all of `group`'s blocks (it has left the running queue): swapped out when the mode
        and host memory allow and its blocks hold KV, else freed to be recomputed."""
        self.num_preemptions += 1
        group.num_preemptions += 1
        out.preempted.append(group)
        kv = self.kv
        seq_ids = [s.seq_id for s in group.live_seqs]
        loading = bool(group.pending_kv_loads)  # its blocks are not filled yet: drop them, never swap
        group.pending_kv_loads.clear()
        if not loading and self.swap and kv.can_swap_out(seq_ids):
            out.swap_out.extend(kv.swap_out(seq_ids))
            self.num_swapped_blocks += len(out.swap_out)
            for s in group.live_seqs:
                s.status = SeqStatus.SWAPPED
            self.queues.swapped.append(group)
            return
        for s in group.live_seqs:
            kv.free(s.seq_id)
            s.num_computed_tokens = 0
            s.status = SeqStatus.WAITING
        self.queues.waiting.appendleft(group)
