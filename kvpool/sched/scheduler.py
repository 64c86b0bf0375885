"""Iteration-level scheduling over the KV manager: who runs this step, with which tokens.

Pure Python and clock-free. Every driver's step is three calls: `out = schedule()`; the
driver carries out the plan (copies, swaps, a forward pass and sampling, or their cost);
`postprocess(out, sampled)` commits the written KV, forks a request's samples on its first
token, runs beam steps, appends tokens, checks every stop condition (stop strings through the
driver's detokenizer hook) and frees what finished.

Policy, in order, each step:
1. running groups, oldest first: decode tokens and prefill chunks within the token budget;
   when a group needs a block and none is free, the latest-arrived running group is
   preempted whole (swap or recompute) until it fits, so the oldest always progresses;
2. swapped groups, oldest first, back in when their blocks fit above the watermark;
3. waiting groups, oldest first (FCFS), admitted while the budget, `max_num_seqs` and the
   free blocks above the watermark allow; prefix-cache hits skip their tokens.
No group is admitted or swapped in during a step that preempted.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvpool.core.kv_manager import KVCacheManager
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.sched.admission import Admission
from kvpool.sched.beam import beam_step
from kvpool.sched.decode_batch import DecodeBatch, plain_decode
from kvpool.sched.output import (
    ExternalLookup,
    KVLoad,
    Sample,
    ScheduledSeq,
    SchedulerOutput,
    TextHook,
)
from kvpool.sched.preemption import Preemption
from kvpool.sched.request import FinishReason, SeqStatus, Sequence, SequenceGroup
from kvpool.sched.stops import Stops

__all__ = ["KVLoad", "Sample", "ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerOutput"]

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    watermark: float = 0.01
    namespace: str = ""
    record_kv_events: bool = False
    kv_group_windows: tuple[int | None, ...] = (None,)  # per layer group (kvpool/core/layer_groups.py)

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")


class Scheduler(Admission, Preemption, Stops):
    """The queues and the step; admission (with store loads), preemption and stop checks are its
    parts in kvpool/sched/admission.py, preemption.py and stops.py."""

    def __init__(self, config: SchedulerConfig, external_kv: ExternalLookup | None = None) -> None:
        self.config = config
        self.external_kv = external_kv
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            eviction_policy=config.eviction_policy,
            num_host_blocks=config.num_host_blocks,
            namespace=config.namespace,
            record_events=config.record_kv_events,
            group_windows=config.kv_group_windows,
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.groups: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        self._load_ids = itertools.count()
        self._watermark_blocks = int(config.watermark * config.num_blocks)
        self.num_preemptions = 0
        self.num_swapped_blocks = 0
        self.num_external_hit_tokens = 0
        self.num_generated_tokens = 0

    # -- requests --------------------------------------------------------------------------
    def new_sequence(self, prompt_token_ids: Iterable[int]) -> Sequence:
        token_ids = list(prompt_token_ids)
        return Sequence(next(self._seq_ids), token_ids, len(token_ids))

    def add_request(self, group: SequenceGroup) -> None:
        """Queue a group; rejects one that could never fit."""
        if group.request_id in self.groups:
            raise InvalidRequest(f"request id {group.request_id!r} is already in use", param="request_id")
        prompt_len = group.seqs[0].prompt_len
        if prompt_len == 0:
            raise InvalidRequest("prompt is empty", param="prompt")
        total = prompt_len + group.params.max_tokens
        if total > self.config.max_model_len:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({group.params.max_tokens}) = {total} "
                f"exceeds the model's context length of {self.config.max_model_len} tokens",
                param="max_tokens" if prompt_len < self.config.max_model_len else "prompt",
            )
        width = group.params.num_samples
        chunk = self.config.max_num_batched_tokens if self.config.enable_chunked_prefill else None
        blocks = width * self.kv.max_blocks(prompt_len, total, chunk)
        if blocks > self.config.num_blocks:
            raise InvalidRequest(
                f"request needs up to {blocks} KV blocks but the cache has only {self.config.num_blocks}",
                param="max_tokens",
            )
        self.groups[group.request_id] = group
        self.waiting.append(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Drop a request wherever it is; its blocks are free when this returns."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for seq in group.live_seqs:
            self.finish_seq(seq, FinishReason.ABORT)
        self._release(group)
        return group

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.live_seqs) for g in self.running)

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Who runs this step and with which blocks (tables valid until `postprocess`)."""
        out = SchedulerOutput()
        self._plan(out)
        table = self.kv.block_table
        out.block_tables = [table(s.seq.seq_id) for s in out.scheduled]
        if self.kv.num_groups > 1:
            tables = [self.kv.block_tables(s.seq.seq_id) for s in out.scheduled]
            out.group_block_tables = [[t[g] for t in tables] for g in range(self.kv.num_groups)]
        return out

    def _plan(self, out: SchedulerOutput) -> None:
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        running = self.running
        num_seqs = 0
        i = 0
        while i < len(running):
            group = running[i]
            if group.pending_kv_loads:
                i += 1
                continue
            live = group.live_seqs
            need = self._tokens_wanted(live, budget)
            if need is None or num_seqs + len(live) > max_seqs:
                break
            if not self._reserve_decode_slots(group, live, out, wanted=need):
                break  # the group preempted itself: every later one is gone too
            budget -= self._emit(group, live, need, out)
            num_seqs += len(live)
            i += 1
        if out.preempted:
            return
        while self.swapped:
            group = self.swapped[0]
            live = group.live_seqs
            seq_ids = [s.seq_id for s in live]
            need = self._tokens_wanted(live, budget)
            if need is None or num_seqs + len(live) > max_seqs:
                return
            # each sequence's next token takes at most one block (a new one or a CoW copy); a
            # prefill chunk, its window groups' blocks (the chunk shrinks to what fits)
            need_blocks = self.kv.num_swap_in_blocks(seq_ids) + len(seq_ids) * self.kv.num_groups
            free = self.kv.num_free_blocks - self._watermark_blocks - need_blocks
            if free < 0 or (self.kv.windowed and not self._fit_chunks(
                    [(i, s) for i, s in enumerate(live) if need[i]], need, free)):
                return
            self.swapped.popleft()
            out.swap_in.extend(self.kv.swap_in(seq_ids))
            self.num_swapped_blocks += len(out.swap_in)
            for seq in live:
                seq.status = SeqStatus.RUNNING
            running.append(group)
            reserved = self._reserve_decode_slots(group, live, out, may_preempt=False, wanted=need)
            assert reserved, "swap-in admitted a group whose next tokens do not fit"
            budget -= self._emit(group, live, need, out)
            num_seqs += len(live)
        while self.waiting and budget > 0:
            group = self.waiting[0]
            live = group.live_seqs
            if num_seqs + len(live) > max_seqs:
                break
            chunk = self._admit(group, out, budget)
            if not chunk:
                break
            if group.pending_kv_loads:  # computes from the next step on, once its KV has landed
                self.waiting.popleft()
                running.append(group)
                continue
            need = self._tokens_wanted(live, chunk)
            if need is None:
                self._unadmit(group, out)
                break
            self.waiting.popleft()
            running.append(group)
            budget -= self._emit(group, live, need, out)
            num_seqs += len(live)

    def postprocess(
        self, out: SchedulerOutput, sampled: list[Sample | None], on_text: TextHook | None = None
    ) -> list[SequenceGroup]:
        """The step ran and `sampled[i]` is what the driver drew for `out.sampling[i]` (None:
        that row's request failed and was aborted). Commit the written KV, fork on a first
        sample, step beams, append tokens, check stops; returns the groups that finished (freed)."""
        self._commit(out)
        beams: dict[str, tuple[SequenceGroup, list]] = {}
        append = self._append
        for s, smp in zip(out.sampling, sampled, strict=True):
            seq = s.seq
            if smp is None or seq.status is SeqStatus.FINISHED:
                continue
            g = s.group
            if g.beam is not None:
                beams.setdefault(g.request_id, (g, []))[1].append((seq, smp.candidates))
                continue
            targets = [seq]
            if s.num_samples > 1 and not g.forked:
                g.forked = True
                targets += [self._fork_sample(g, seq, i) for i in range(1, s.num_samples)]
            tokens, lps, tops = smp.token_ids, smp.logprobs, smp.top_logprobs
            for j, t in enumerate(targets):
                append(g, t, tokens[j], lps[j] if lps else 0.0, tops[j] if tops else None, on_text)
        for g, rows in beams.values():
            self.num_generated_tokens += beam_step(self, g, rows)
        return self.free_finished()

    def plain_decode(self) -> DecodeBatch | None:
        """A shortcut for drivers that step many times between changes: when the next steps
        are plain decode steps, the batch whose `step(tokens)` is `schedule()` + `postprocess()`
        of one of them (see kvpool/sched/decode_batch.py), else None."""
        return plain_decode(self)

    def _commit(self, out: SchedulerOutput) -> None:
        """The step ran: its KV is written. Advance and register the computed blocks."""
        commit = self.kv.commit
        for s in out.scheduled:
            seq = s.seq
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_computed_tokens = computed = s.start + s.num_new_tokens
            commit(seq.seq_id, seq.token_ids, computed)

    def _fork_sample(self, group: SequenceGroup, seq: Sequence, index: int) -> Sequence:
        child = self.fork(group, seq)
        child.sample_index = index
        return child

    def fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        """A new sequence sharing every block of `parent` (copy-on-write on its next write)."""
        child = Sequence(
            next(self._seq_ids), list(parent.token_ids), parent.prompt_len, parent.num_computed_tokens,
            parent.status, cumulative_logprob=parent.cumulative_logprob,
            logprobs=list(parent.logprobs), top_logprobs=list(parent.top_logprobs),
        )
        self.kv.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)
        return child

    def drop_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """Remove a sequence from its group entirely (a pruned beam)."""
        if self.kv.has_seq(seq.seq_id):
            self.kv.free(seq.seq_id)
        group.seqs.remove(seq)

    def free_finished(self) -> list[SequenceGroup]:
        """Remove and return the groups whose every sequence has finished."""
        done = [g for g in self.running if g.is_finished]
        for g in done:
            self._release(g)
        return done

    # -- internals -------------------------------------------------------------------------
    def _tokens_wanted(self, live: list[Sequence], budget: int) -> list[int] | None:
        """Tokens each live sequence of a group computes this step (0 = sits out), or None if
        the group cannot run: decode tokens are all or nothing, prefill chunks share what is left."""
        if len(live) == 1:  # the common case, on the hot path
            seq = live[0]
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            if remaining == 1:
                return [1] if budget >= 1 else None
            if remaining < 1:
                return None
            take = min(remaining, budget) if self.config.enable_chunked_prefill else remaining
            return [take] if 0 < take <= budget else None
        wanted = [0] * len(live)
        for i, seq in enumerate(live):
            if len(seq.token_ids) - seq.num_computed_tokens == 1:
                wanted[i] = 1
        budget -= sum(wanted)
        if budget < 0:
            return None
        for i, seq in enumerate(live):
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            if remaining > 1:
                take = min(remaining, budget) if self.config.enable_chunked_prefill else remaining
                if take > budget:
                    return None
                wanted[i] = take
                budget -= take
        return wanted if any(wanted) else None

    def _emit(self, group: SequenceGroup, live: list[Sequence], wanted: list[int], out: SchedulerOutput) -> int:
        group.first_scheduled = True
        scheduled = out.scheduled
        params = group.params
        k = params.num_samples  # n, or best_of samples of which the n best are returned
        width = k if k > 1 and not group.forked and not params.use_beam_search else 1
        for seq, n in zip(live, wanted, strict=True):
            if n:
                start = seq.num_computed_tokens
                samples = start + n == len(seq.token_ids)
                scheduled.append(ScheduledSeq(group, seq, start, n, samples, (width if samples else 0)))
        total = sum(wanted)
        out.num_batched_tokens += total
        return total

    def _release(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            if self.kv.has_seq(seq.seq_id):
                self.kv.free(seq.seq_id)
        self.groups.pop(group.request_id, None)
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
