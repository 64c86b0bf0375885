"""Iteration-level scheduling over the KV manager: who runs this step, with which tokens.

Pure Python and clock-free. Every driver's step is three calls: `out = schedule()`; the
driver carries out the plan (copies, swaps, a forward pass and sampling, or their cost);
`postprocess(out, sampled)` commits the written KV, forks a request's samples on its first
token, runs beam steps, appends tokens, checks every stop condition and frees what finished.
Stop strings need text, which only the driver has: its output processor reports a hit with
`stop_at_strings` before the next `schedule()`, and the sequence stops here, in the core.

Policy, in order, each step:
1. running groups, oldest first: decode tokens and prefill chunks within the token budget;
   when a group needs a block and none is free, the latest-arrived running group is
   preempted whole (swap or recompute) until it fits, so the oldest always progresses;
2. swapped groups, oldest first, back in when their blocks fit above the watermark;
3. waiting groups, oldest first (FCFS), cache hits or least work first within a bypass bound
   (`WaitingOrder`, waiting_order.py), admitted while the budget, `max_num_seqs` and the
   free blocks above the watermark allow; prefix-cache hits skip their tokens. Under
   shortest-prefill a part-computed prompt's next chunk waits in step 1 until the shorter
   waiting prompts are admitted.
No group is admitted or swapped in during a step that preempted.
The policies are parts, each given the KV manager and what else it needs: `Admission`
(admission.py), `Preemption` (preemption.py), `Stops` (stops.py), `BeamSearch` (beam.py),
`Forks` (forks.py), over the shared `Queues` (queues.py); this module sequences them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvpool.core.kv_manager import KVCacheManager
from kvpool.core.miss_reasons import INTEGRITY, LOAD_FAILED
from kvpool.core.retention import retain_hashes
from kvpool.core.rewind import rewind as rewind_kv
from kvpool.errors import InvalidRequest, KVStateError
from kvpool.sched.admission import Admission
from kvpool.sched.beam import BeamSearch
from kvpool.sched.chunks import tokens_wanted
from kvpool.sched.config import SchedulerConfig
from kvpool.sched.decode_batch import DecodeBatch, plain_decode
from kvpool.sched.forks import Forks
from kvpool.sched.output import (
    ConstraintHook,
    ExternalLookup,
    KVLoad,
    Sample,
    ScheduledSeq,
    SchedulerOutput,
)
from kvpool.sched.preemption import Preemption
from kvpool.sched.queues import Queues
from kvpool.sched.request import FinishReason, SeqStatus, Sequence, SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.stops import Stops
from kvpool.sched.waiting_order import WaitingOrder

__all__ = ["KVLoad", "Sample", "ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


class Scheduler:
    """The queues and the step, sequencing its parts."""

    def __init__(self, config: SchedulerConfig, external_kv: ExternalLookup | None = None) -> None:
        self.config = config
        self.kv = kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            eviction_policy=config.eviction_policy,
            num_host_blocks=config.num_host_blocks,
            namespace=config.namespace,
            record_events=config.record_kv_events,
            group_windows=config.kv_group_windows,
        )
        watermark_blocks = int(config.watermark * config.num_blocks)
        self.queues = queues = Queues(kv)
        self.admission = Admission(kv, config.enable_chunked_prefill, watermark_blocks, external_kv)
        self.preemption = Preemption(kv, queues, config.preemption_mode, watermark_blocks)
        self.waiting_order = WaitingOrder(kv, self.admission.hashes, config.scheduling_policy,
                                          config.max_bypass)
        self.stops = Stops(kv)
        self.forks = Forks(kv)
        self.beams = BeamSearch(self.forks, self.stops)

    # -- state, as the drivers read it -----------------------------------------------------
    @property
    def waiting(self) -> deque[SequenceGroup]:
        return self.queues.waiting

    @property
    def running(self) -> list[SequenceGroup]:
        return self.queues.running

    @property
    def swapped(self) -> deque[SequenceGroup]:
        return self.queues.swapped

    @property
    def groups(self) -> dict[str, SequenceGroup]:
        return self.queues.groups

    @property
    def external_kv(self) -> ExternalLookup | None:
        """How many blocks, from the first, the external KV store holds (None: no store)."""
        return self.admission.external_kv

    @external_kv.setter
    def external_kv(self, lookup: ExternalLookup | None) -> None:
        self.admission.external_kv = lookup

    @property
    def num_preemptions(self) -> int:
        return self.preemption.num_preemptions

    @property
    def num_swapped_blocks(self) -> int:
        return self.preemption.num_swapped_blocks

    @property
    def num_external_hit_tokens(self) -> int:
        return self.admission.num_external_hit_tokens

    @property
    def num_generated_tokens(self) -> int:
        return self.stops.num_generated_tokens

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.live_seqs) for g in self.running)

    def has_unfinished(self) -> bool:
        return self.queues.has_unfinished()

    # -- requests --------------------------------------------------------------------------
    def new_sequence(self, prompt_token_ids: Iterable[int]) -> Sequence:
        return self.forks.new(prompt_token_ids)

    def add_request(self, group: SequenceGroup) -> None:
        """Queue a group the driver has validated (`check_capacity` is the core's part of that:
        the engine's `InputProcessor` is the one station that refuses requests)."""
        if group.request_id in self.groups:
            raise InvalidRequest(f"request id {group.request_id!r} is already in use", param="request_id")
        self.groups[group.request_id] = group
        self.waiting.append(group)
        if self.kv.pool.retention is not None:  # an arrival is a time the driver passed
            self.kv.pool.retention.advance(group.arrival_time)
        for retention in group.params.retention:  # by hash (admission's): holds once the blocks register
            retain_hashes(self.kv, self.admission.hashes(group, group.seqs[0]), retention, group.arrival_time)

    def check_capacity(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise InvalidRequest when a group of `prompt_len` prompt tokens could never hold
        its KV in this cache (it would wait forever)."""
        chunk = self.config.max_num_batched_tokens if self.config.enable_chunked_prefill else None
        blocks = params.num_samples * self.kv.max_blocks(prompt_len, prompt_len + params.max_tokens, chunk)
        if blocks > self.config.num_blocks:
            raise InvalidRequest(
                f"request needs up to {blocks} KV blocks but the cache has only {self.config.num_blocks}",
                param="max_tokens",
            )

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Drop a request wherever it is; its blocks are free when this returns."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for seq in group.live_seqs:
            self.stops.finish(seq, FinishReason.ABORT)
        self.queues.release(group)
        return group

    def finish_seq(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a sequence (the driver's verdict on a failed row); its blocks are freed."""
        self.stops.finish(seq, reason, stop_reason)

    def stop_at_strings(self, hits: Iterable[tuple[Sequence, str]]) -> list[SequenceGroup]:
        """The output processor found stop string `stop` in the text of `seq`'s newest tokens
        (`kvpool/engine/output_processor.py`): stop it (`Stops.stop_string`); returns the groups
        that finished with it (freed)."""
        for seq, stop in hits:
            self.stops.stop_string(seq, stop)
        return self.queues.free_finished()

    def early_stop_tokens(self, group: SequenceGroup, seq: Sequence) -> list[int]:
        """Tokens the sampler must not draw for `seq` now (`Stops.early_stop_tokens`)."""
        return self.stops.early_stop_tokens(group, seq)

    def kv_load_valid(self, load: KVLoad) -> bool:
        """The blocks a load was planned into are still its sequence's (`Admission.kv_load_valid`)."""
        return self.admission.kv_load_valid(load)

    def finish_kv_load(self, load: KVLoad, num_loaded: int, why: str = LOAD_FAILED) -> None:
        """A planned load landed with its first `num_loaded` blocks, short for reason `why`
        (`Admission.finish_kv_load`)."""
        self.admission.finish_kv_load(load, num_loaded, why)

    def rewind(self, group: SequenceGroup, seq: Sequence, num_tokens: int, out: SchedulerOutput | None = None,
               why: str = INTEGRITY) -> None:
        """`seq`'s store hit is good only up to token `num_tokens` (a block failed its check while
        `out`'s forward read it, layer by layer): its KV from there is taken back (core/rewind.py)
        and computed again from a later step. Its row in `out` is `rewound`: nothing of it is
        committed or appended (its sample came from bad KV). The tokens lost count as `why` misses."""
        if not 0 <= num_tokens <= seq.num_computed_tokens:
            raise KVStateError(f"cannot rewind sequence {seq.seq_id} to token {num_tokens}: "
                               f"{seq.num_computed_tokens} are computed")
        rewind_kv(self.kv, seq.seq_id, num_tokens)
        for s in out.scheduled if out is not None else ():
            if s.seq is seq:
                s.rewound = True
        self.admission.rewind_store_hit(group, seq, num_tokens, why)

    # -- the step --------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Who runs this step and with which blocks (tables valid until `postprocess`). `now`,
        the driver's time, is what retention TTLs expire against (core/retention.py)."""
        if now is not None and self.kv.pool.retention is not None:
            self.kv.pool.retention.advance(now)
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
        running, order = self.running, self.waiting_order
        reserve, chunked = self.preemption.reserve_decode_slots, self.config.enable_chunked_prefill
        partials: list[tuple[int, SequenceGroup]] = []  # (tokens left, group): offered the step after shorter prompts
        num_seqs = 0
        i = 0
        while i < len(running):
            group = running[i]
            if group.pending_kv_loads:
                i += 1
                continue
            left = order.competes(group, self.waiting)
            if left:
                partials.append((left, group))
                i += 1
                continue
            live = group.live_seqs
            need = tokens_wanted(live, budget, chunked)
            if need is None or num_seqs + len(live) > max_seqs:
                break
            if not reserve(group, live, out, wanted=need):
                break  # the group preempted itself: every later one is gone too
            budget -= self._emit(group, live, need, out)
            num_seqs += len(live)
            i += 1
        if out.preempted:
            for _, group in partials:
                group.num_bypassed += 1  # sits this step out too (counted: the bound holds)
            return
        swapped = self.swapped
        while swapped:
            group = swapped[0]
            live = group.live_seqs
            need = tokens_wanted(live, budget, chunked)
            if need is None or num_seqs + len(live) > max_seqs:
                return
            if not self.preemption.swap_in(group, live, need, out):
                return
            budget -= self._emit(group, live, need, out)
            num_seqs += len(live)
        work = 0  # prompt tokens this step computes for the groups it admits
        computing = order.computing(running) if self.waiting else None
        if partials:
            budget, num_seqs, work = self._admit(out, budget, num_seqs, work, computing,
                                                 below=min(p[0] for p in partials))
            for left, group in partials:
                live = group.live_seqs
                if order.defers(group, work, left):
                    group.num_bypassed += 1  # it sat this step out for shorter prompts
                    continue
                need = tokens_wanted(live, budget, chunked)
                if need is None or num_seqs + len(live) > max_seqs:
                    continue
                if not reserve(group, live, out, may_preempt=False, wanted=need):
                    continue
                emitted = self._emit(group, live, need, out)
                budget -= emitted
                work += emitted
                num_seqs += len(live)
        self._admit(out, budget, num_seqs, work, computing)

    def _admit(self, out: SchedulerOutput, budget: int, num_seqs: int, work: int, computing: set | None,
               below: int | None = None) -> tuple[int, int, int]:
        """Admit waiting groups in the waiting order while the budget, `max_num_seqs` and the
        blocks last (with `below`: only those with fewer prompt tokens to compute). `work`: the
        prompt tokens this step computes so far; `computing`: the prompt blocks running groups
        compute (`WaitingOrder.awaits`), grown by each admission. Returns the budget, seats and
        work after."""
        waiting, order, running = self.waiting, self.waiting_order, self.running
        while waiting and budget > 0:
            group = order.pick(waiting, computing)
            if group is None:
                break
            live = group.live_seqs
            if num_seqs + len(live) > self.config.max_num_seqs or order.defers(group, work):
                break
            if below is not None and order.prefill_work(group) >= below:
                break
            chunk = self.admission.admit(group, out, budget)
            if not chunk:
                break
            if group.pending_kv_loads:  # computes from the next step on, once its KV has landed
                order.admitted(waiting, group)
                running.append(group)
                continue
            need = tokens_wanted(live, chunk, self.config.enable_chunked_prefill)
            if need is None:
                self.admission.unadmit(group, out)
                break
            order.admitted(waiting, group)
            running.append(group)
            emitted = self._emit(group, live, need, out)
            budget -= emitted
            work += emitted
            num_seqs += len(live)
            if computing is not None:
                computing |= order.computing((group,)) or set()
        return budget, num_seqs, work

    def postprocess(
        self, out: SchedulerOutput, sampled: list[Sample | None], constraint: ConstraintHook | None = None
    ) -> list[SequenceGroup]:
        """The step ran and `sampled[i]` is what the driver drew for `out.sampling[i]` (None:
        that row's request failed and was aborted). Commit the written KV, fork on a first
        sample, step beams, append tokens, check stops (a grammar's end through `constraint`);
        returns the groups that finished (freed). Stop strings need text: the driver reports
        them afterwards (`stop_at_strings`)."""
        self._commit(out)
        beams: dict[str, tuple[SequenceGroup, list]] = {}
        append = self.stops.append
        for s, smp in zip(out.sampling, sampled, strict=True):
            seq = s.seq
            if smp is None or seq.status is SeqStatus.FINISHED or s.rewound:
                continue
            g = s.group
            if g.beam is not None:
                beams.setdefault(g.request_id, (g, []))[1].append((seq, smp.candidates))
                continue
            if g.params.max_tokens == 0:  # prompt logprobs only: done once the prompt is computed
                self.stops.finish(seq, FinishReason.LENGTH)
                continue
            targets = [seq]
            if s.num_samples > 1 and not g.forked:
                g.forked = True
                targets += [self._fork_sample(g, seq, i) for i in range(1, s.num_samples)]
            tokens, lps, tops = smp.token_ids, smp.logprobs, smp.top_logprobs
            for j, t in enumerate(targets):
                append(g, t, tokens[j], lps[j] if lps else 0.0, tops[j] if tops else None, constraint)
        for g, rows in beams.values():
            self.stops.num_generated_tokens += self.beams.step(g, rows)
        return self.queues.free_finished()

    def plain_decode(self) -> DecodeBatch | None:
        """A shortcut for drivers that step many times between changes: when the next steps
        are plain decode steps, the batch whose `step(tokens)` is `schedule()` + `postprocess()`
        of one of them (see kvpool/sched/decode_batch.py), else None."""
        return plain_decode(self.kv, self.queues, self.stops, self.config)

    def _commit(self, out: SchedulerOutput) -> None:
        """The step ran: its KV is written. Advance and register the computed blocks."""
        commit = self.kv.commit
        for s in out.scheduled:
            seq = s.seq
            if seq.status is SeqStatus.FINISHED or s.rewound:
                continue
            seq.num_computed_tokens = computed = s.start + s.num_new_tokens
            commit(seq.seq_id, seq.token_ids, computed)

    def _fork_sample(self, group: SequenceGroup, seq: Sequence, index: int) -> Sequence:
        child = self.forks.fork(group, seq)
        child.sample_index = index
        return child

    def fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        """A new sequence sharing every block of `parent` (copy-on-write on its next write)."""
        return self.forks.fork(group, parent)

    # -- internals -------------------------------------------------------------------------
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
