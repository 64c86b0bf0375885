"""Many plain decode steps in one call, for a driver that needs only their outcome (the
simulator between events, where per-step calls dominate a trace-length run).

`leap(batch, steps, token_ids)` leaves the KV manager, the sequences and the stop counters as
`steps` calls of `DecodeBatch.step` would: the steps' blocks are taken and registered in one pass
in the order the steps take them (`core/leap_slots.py`), or, where that pass cannot be exact,
every step that opens or fills a block makes the same `append_slots` / `commit` call as `step`
does, in the same order (so the same blocks, evictions, registrations and events), the slot
reservations of the steps in between merged into the next call. Tokens are appended without stop checks, so a leap covers
only steps in which no sequence can stop (`leap_steps`): the last step of a batch, which may reach
max_tokens, is left to `DecodeBatch.step`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvpool.core.kv_manager import KVCacheManager
from kvpool.core.leap_slots import leap_slots
from kvpool.errors import KVStateError
from kvpool.sched.decode_batch import DecodeBatch
from kvpool.sched.request import Sequence, SequenceGroup


def leap_steps(batch: DecodeBatch) -> int:
    """How many of the batch's next steps `leap` may take: all but the last, unless a stop token,
    EOS or logprobs make a step's outcome depend on its tokens, or a sliding window frees blocks
    at other steps than those that fill one (then none)."""
    if batch.kv.windowed:
        return 0
    for g, _ in batch.seqs:
        p = g.params
        if p.stop_token_ids or not p.ignore_eos or p.logprobs is not None:
            return 0
    return max(batch.steps - 1, 0)


def leap(batch: DecodeBatch, steps: int, token_ids: Seq[int]) -> None:
    """Take `steps` plain steps; `token_ids` holds each step's tokens in turn (step-major, one per
    sequence, as `DecodeBatch.step` takes them). The batch then has `steps` fewer steps left."""
    seqs = batch.seqs
    b = len(seqs)
    if not 0 <= steps <= leap_steps(batch):
        raise KVStateError(f"cannot leap {steps} steps: at most {leap_steps(batch)} of {batch.steps} are plain")
    if len(token_ids) != steps * b:
        raise KVStateError(f"a leap of {steps} steps over {b} sequences takes {steps * b} tokens, got {len(token_ids)}")
    if steps == 0:
        return
    kv = batch.kv
    before = [len(seq.token_ids) for _, seq in seqs]  # n: the KV holds slots for n - 1 tokens
    for j, (_, seq) in enumerate(seqs):
        seq.token_ids.extend(token_ids[j::b])
    if not leap_slots(kv, [seq.seq_id for _, seq in seqs], [seq.token_ids for _, seq in seqs], steps):
        _slots_step_by_step(kv, seqs, before, steps)
    for (_, seq), n in zip(seqs, before, strict=True):
        seq.num_computed_tokens = n - 1 + steps
    batch.stops.num_generated_tokens += steps * b
    batch.steps -= steps


def _slots_step_by_step(kv: KVCacheManager, seqs: list[tuple[SequenceGroup, Sequence]], before: list[int],
                        steps: int) -> None:
    """The steps' `append_slots` / `commit` calls as `DecodeBatch.step` makes them, except that the
    reservations of steps that neither open nor fill a block are merged into the next call."""
    B, b = kv.block_size, len(seqs)
    append, commit = kv.append_slots, kv.commit
    by_phase: dict[int, list[int]] = {}  # (n - 1) % B -> the sequences (in batch order)
    for j, n in enumerate(before):
        by_phase.setdefault((n - 1) % B, []).append(j)
    synced = [0] * b  # steps whose slot each sequence has reserved
    for i in range(steps):
        opens = by_phase.get(-i % B)  # step i's slot starts a new block: (n - 1 + i) % B == 0
        fills = by_phase.get((-i - 1) % B)  # step i fills the last block: (n + i) % B == 0
        for j in opens or ():
            append(seqs[j][1].seq_id, i + 1 - synced[j])
            synced[j] = i + 1
        for j in fills or ():
            seq = seqs[j][1]
            if synced[j] <= i:
                append(seq.seq_id, i + 1 - synced[j])
                synced[j] = i + 1
            commit(seq.seq_id, seq.token_ids, before[j] + i)
    for j, (_, seq) in enumerate(seqs):
        if synced[j] < steps:
            append(seq.seq_id, steps - synced[j])
