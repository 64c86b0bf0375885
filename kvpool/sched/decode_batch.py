"""Plain decode steps: the common step in which every running sequence decodes one token and
nothing else can happen, taken without building a SchedulerOutput.

A driver that steps many times between changes (the simulator between arrivals) asks
`Scheduler.plain_decode()` for the batch; until a sequence finishes or anything else calls the
scheduler, `DecodeBatch.step(tokens)` does exactly what `schedule()` + `postprocess()` would do,
through the same parts: the same slot reservations and commits in the same order (the KV
manager), then the same token appends and stop checks (`Stops.append`) and frees
(`Queues.free_finished`), so the KV state, its events and its statistics are identical
(tests/sched compares the two paths).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.config import SchedulerConfig
from kvpool.sched.queues import Queues
from kvpool.sched.request import Sequence, SequenceGroup
from kvpool.sched.stops import Stops


@dataclass(slots=True)
class DecodeBatch:
    """The running sequences in schedule order (groups oldest first, then each group's live
    sequences) and how many plain steps free blocks cover without preempting."""

    seqs: list[tuple[SequenceGroup, Sequence]]
    steps: int
    kv: KVCacheManager
    stops: Stops
    queues: Queues

    def step(self, token_ids: Seq[int]) -> list[SequenceGroup]:
        """One step's `schedule()` + `postprocess()`: a slot for each newest token, commit, then
        append `token_ids[i]` to `seqs[i]` with every stop check. Returns the groups that
        finished (freed); after a finish the batch is spent. A sequence's full blocks are all
        committed (checked by `plain_decode`), so only a step that fills a block registers one."""
        kv = self.kv
        append, commit, B = kv.append_slots, kv.commit, kv.block_size
        windowed = kv.windowed  # window groups free a block at other positions than n % B == 0
        for _, seq in self.seqs:
            append(seq.seq_id, 1)
        for _, seq in self.seqs:
            seq.num_computed_tokens = n = seq.num_computed_tokens + 1
            if n % B == 0 or windowed:
                commit(seq.seq_id, seq.token_ids, n)
        add = self.stops.append
        finished = False
        for (g, seq), token in zip(self.seqs, token_ids, strict=True):
            finished |= add(g, seq, token)
        return self.queues.free_finished() if finished else []


def plain_decode(kv: KVCacheManager, queues: Queues, stops: Stops, cfg: SchedulerConfig) -> DecodeBatch | None:
    """The batch when the next steps are plain decode steps, else None. Plain: no group waits,
    is swapped out or loads KV; every group has one live sequence (no forks, no beams) past its
    prompt with exactly its newest token to compute and, in the KV manager, no slot for it yet,
    its full blocks committed and no shared partial last block (`decode_steps`); the batch fits
    `max_num_seqs` and the token budget. `steps` (>= 1) stops at the step in which the first
    sequence reaches max_tokens and never needs more blocks than are free, so no step preempts."""
    if queues.waiting or queues.swapped or not queues.running:
        return None
    seqs: list[tuple[SequenceGroup, Sequence]] = []
    steps = cfg.max_model_len
    for group in queues.running:
        if group.pending_kv_loads or not group.first_scheduled or group.params.n > 1:
            return None
        for seq in group.live_seqs:
            n = len(seq.token_ids)
            if n - seq.num_computed_tokens != 1 or n <= seq.prompt_len:
                return None
            seqs.append((group, seq))
            steps = min(steps, group.params.max_tokens - (n - seq.prompt_len))
    if len(seqs) > min(cfg.max_num_seqs, cfg.max_num_batched_tokens) or steps < 1:
        return None
    steps = kv.decode_steps([(seq.seq_id, len(seq.token_ids)) for _, seq in seqs], steps)
    return DecodeBatch(seqs, steps, kv, stops, queues) if steps else None
