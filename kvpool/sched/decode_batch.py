"""Plain decode steps: the common step in which every running sequence decodes one token and
nothing else can happen, taken without building a SchedulerOutput.

A driver that steps many times between changes (the simulator between arrivals) asks
`Scheduler.plain_decode()` for the batch; until a sequence finishes or anything else calls the
scheduler, `DecodeBatch.step(tokens)` does exactly what `schedule()` + `postprocess()` would do:
the same slot reservations, the same commits in the same order, then the same token appends
and stop checks (`Scheduler._append`), so the KV state, its events and its statistics are
identical (tests/sched compares the two paths).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.sched.fit import largest_fitting
from kvpool.sched.request import Sequence, SequenceGroup

if TYPE_CHECKING:
    from kvpool.sched.scheduler import Scheduler


@dataclass(slots=True)
class DecodeBatch:
    """The running sequences in schedule order (groups oldest first, then each group's live
    sequences) and how many plain steps free blocks cover without preempting."""

    seqs: list[tuple[SequenceGroup, Sequence]]
    steps: int
    sched: Scheduler

    def step(self, token_ids: Seq[int]) -> list[SequenceGroup]:
        """One step's `schedule()` + `postprocess()`: a slot for each newest token, commit, then
        append `token_ids[i]` to `seqs[i]` with every stop check. Returns the groups that
        finished (freed); after a finish the batch is spent. A sequence's full blocks are all
        committed (checked by `plain_decode`), so only a step that fills a block registers one."""
        sched = self.sched
        kv = sched.kv
        append, commit, B = kv.append_slots, kv.commit, kv.block_size
        windowed = kv.windowed  # window groups free a block at other positions than n % B == 0
        for _, seq in self.seqs:
            append(seq.seq_id, 1)
        for _, seq in self.seqs:
            seq.num_computed_tokens = n = seq.num_computed_tokens + 1
            if n % B == 0 or windowed:
                commit(seq.seq_id, seq.token_ids, n)
        add = sched._append
        finished = False
        for (g, seq), token in zip(self.seqs, token_ids, strict=True):
            finished |= add(g, seq, token)
        return sched.free_finished() if finished else []


def plain_decode(sched: Scheduler) -> DecodeBatch | None:
    """The batch when the next steps are plain decode steps, else None. Plain: no group waits,
    is swapped out or loads KV; every group has one live sequence (no forks, no beams) past its
    prompt with exactly its newest token to compute, no slot for it yet and its full blocks
    committed; no partial last block is shared (no copy-on-write); the batch fits
    `max_num_seqs` and the token budget. `steps` (>= 1) stops at the step in which the first
    sequence reaches max_tokens and never needs more blocks than are free, so no step preempts."""
    if sched.waiting or sched.swapped or not sched.running:
        return None
    kv, cfg = sched.kv, sched.config
    B = cfg.block_size
    caching = kv.enable_prefix_caching
    # Read-only views of the manager's records, read directly: this runs once per batch over
    # every running sequence on the simulator's hottest path, where a method call per sequence shows.
    entries, ref_counts = kv.seqs, kv.pool.ref_counts
    seqs: list[tuple[SequenceGroup, Sequence]] = []
    slots: list[int] = []  # tokens with a slot, per sequence
    held = 0
    steps = cfg.max_model_len
    for group in sched.running:
        if group.pending_kv_loads or not group.first_scheduled or group.params.n > 1:
            return None
        for seq in group.live_seqs:
            n = len(seq.token_ids)
            entry = entries[seq.seq_id]
            if n - seq.num_computed_tokens != 1 or n <= seq.prompt_len or entry.num_tokens != n - 1:
                return None
            if caching and entry.num_registered != (n - 1) // B:
                return None
            if entry.num_tokens % B and ref_counts[entry.blocks[-1]] > 1:  # kv.last_block_shared, inlined
                return None
            seqs.append((group, seq))
            slots.append(entry.num_tokens)
            held += len(entry.blocks)
            steps = min(steps, group.params.max_tokens - (n - seq.prompt_len))
    if len(seqs) > min(cfg.max_num_seqs, cfg.max_num_batched_tokens) or steps < 1:
        return None
    # every group's table grows alike: G blocks per new block of group 0 (frees not counted on)
    steps = _steps_within(slots, held, B, steps, kv.num_free_blocks // kv.num_groups)
    return DecodeBatch(seqs, steps, sched) if steps else None


def _steps_within(slots: list[int], held: int, block_size: int, steps: int, free: int) -> int:
    """The most steps, at most `steps`, whose new blocks fit in `free` (0 when not one)."""
    return largest_fitting(lambda m: sum([-(-(n + m) // block_size) for n in slots]) - held <= free, steps)
