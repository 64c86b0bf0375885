"""One simulated engine instance: the real Scheduler driven by a cost model and a virtual clock.

`SimInstance.step(now)` is `Engine.step()` with the model replaced by `CostModel.step_time`:
schedule, cost the batch (new tokens, context lengths, block copies and swaps), update,
sample placeholder tokens, fork/drop sequences, free finished groups. Policies all live in
the scheduler and the KV manager; nothing here decides who runs. `decode_run` takes the
commonest step, a plain decode step (`kvpool.sched.decode_batch`), with the same results
but without building a schedule, for drivers that step many times between changes.

Token ids: prompts are `[marker] * prompt_len` with a marker unique to the request, and
their full-block hashes are given precomputed (from the workload's chunks), so prefix reuse
is exact for full prompt blocks. Blocks filled later (the partial prompt tail plus output)
hash from unique placeholder tokens: they never collide across requests.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from kvpool.cluster.records import InstanceLoad
from kvpool.core.hashing import BlockHash
from kvpool.core.kv_manager import KVCacheManager
from kvpool.costs.cost_model import CostModel, StepBatch
from kvpool.errors import ConfigError
from kvpool.sched.decode_batch import DecodeBatch, decode_batch
from kvpool.sched.request import SeqStatus, SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpool.sim.metrics import RequestMetrics
from kvpool.sim.tokens import BlockHasher, TokenSynth
from kvpool.sim.workloads import SimRequest

_MARKER_BASE = 1 << 48  # placeholder token ids, above any vocabulary
_SEED_SEQ_ID = -1  # a sequence id the scheduler never hands out


@dataclass(slots=True)
class StepResult:
    """What one step did: its duration and the requests that emitted a token or finished."""

    duration: float
    tokens: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    batch_size: int = 0


@dataclass(slots=True)
class InstanceCounters:
    steps: int = 0
    busy_s: float = 0.0
    batched_requests: int = 0  # summed over steps (mean = / steps)
    prefill_tokens: int = 0  # prompt tokens computed (recomputation included)
    generated_tokens: int = 0


class SimInstance:
    """An engine instance in virtual time. `step(now)` runs one iteration and returns its
    duration; the driver advances the clock."""

    def __init__(
        self,
        instance_id: str,
        config: SchedulerConfig,
        cost_model: CostModel,
        hasher: BlockHasher | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.sched = Scheduler(config)
        self.cost_model = cost_model
        self.hasher = hasher or BlockHasher(config.block_size, TokenSynth(), config.namespace)
        self.metrics: dict[str, RequestMetrics] = {}
        self.counters = InstanceCounters()
        self._markers = itertools.count(_MARKER_BASE)
        self._last_end = -math.inf  # when the last step ended: a step after a pause pays a wake-up

    # -- requests ----------------------------------------------------------------------------
    def hashes_for(self, req: SimRequest) -> list[BlockHash]:
        if not self.sched.config.enable_prefix_caching:
            return []
        return self.hasher.hashes(req.chunks)

    def add(
        self,
        req: SimRequest,
        now: float,
        *,
        max_tokens: int | None = None,
        extra_prompt_tokens: int = 0,
        prompt_hashes: Sequence[BlockHash] | None = None,
        metrics: RequestMetrics | None = None,
    ) -> RequestMetrics:
        """Queue `req` (arriving at `now`). `extra_prompt_tokens` lengthens the prompt by
        tokens generated elsewhere (a decode instance receiving a prefilled request)."""
        prompt_len = req.prompt_len + extra_prompt_tokens
        seq = self.sched.new_sequence(itertools.repeat(next(self._markers), prompt_len))
        width = max(req.n, req.beam_width)
        params = SamplingParams(
            n=width, max_tokens=max_tokens or req.output_len, ignore_eos=True,
            use_beam_search=req.beam_width > 1,
        )
        hashes = list(prompt_hashes) if prompt_hashes is not None else self.hashes_for(req)
        group = SequenceGroup(req.request_id, [seq], params, now, prompt_hashes=hashes)
        self.sched.add_request(group)
        m = metrics or RequestMetrics(req.request_id, req.arrival_s, req.prompt_len)
        self.metrics[req.request_id] = m
        return m

    def seed_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """Write blocks received from elsewhere (a transfer or a pull) into the prefix cache."""
        if not self.sched.config.enable_prefix_caching:
            return 0
        return write_blocks(self.sched.kv, hashes)

    # -- the step ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.sched.has_unfinished()

    def step(self, now: float) -> StepResult:
        sched = self.sched
        out = sched.schedule()
        scheduled = out.scheduled
        if not scheduled:
            return StepResult(0.0)
        batch = StepBatch(
            [s.num_new_tokens for s in scheduled],
            [s.start + s.num_new_tokens for s in scheduled],
            blocks_copied=len(out.copies),
            blocks_swapped_in=len(out.swap_in),
            blocks_swapped_out=len(out.swap_out),
            idle_s=now - self._last_end,
        )
        duration = self.cost_model.step_time(batch)
        end = self._last_end = now + duration
        sched.update(out)
        result = StepResult(duration, batch_size=len({id(s.group) for s in scheduled}))
        self._count(out, duration, result.batch_size)
        self._sample(out, end, result)
        self._free_finished(end, result)
        return result

    def decode_run(self, now: float, until: float) -> Iterator[StepResult]:
        """Plain decode steps (`kvpool.sched.decode_batch`) from `now` while each starts before
        `until` (the first always runs): the very steps `step()` would take, with the same
        results, but without building a schedule per step. Yields each step's result; ends at the
        first step that is not plain (or takes no time, or follows a pause), which `step()` then
        takes."""
        if now > self._last_end:  # the instance was idle: the step's cost depends on the pause
            return
        first = True
        while True:
            batch = decode_batch(self.sched)
            if batch is None or not all(g.params.n == 1 and not g.params.use_beam_search for g, _ in batch.seqs):
                return
            cost = self._plain_decode_cost(len(batch.seqs))
            for _ in range(batch.steps):
                if not first and now >= until:
                    return
                duration = cost([len(seq.token_ids) for _, seq in batch.seqs])
                if duration == 0.0:
                    return
                first = False
                result = self._decode_step(batch, duration, now + duration)
                now += duration
                yield result
                if result.finished:
                    break

    def _plain_decode_cost(self, batch_size: int) -> Callable[[list[int]], float]:
        """Step time of a plain decode step from its context lengths: the cost model's own
        shortcut when it has one (`RooflineCostModel.plain_decode_time`), else `step_time`."""
        shortcut = getattr(self.cost_model, "plain_decode_time", None)
        if shortcut is not None:
            return shortcut
        ones = [1] * batch_size
        return lambda context_lens: self.cost_model.step_time(StepBatch(ones, context_lens))

    def _decode_step(self, batch: DecodeBatch, duration: float, end: float) -> StepResult:
        """`step()` for a plain decode batch of single-sample groups."""
        self._last_end = end
        batch.step()
        seqs = batch.seqs
        result = StepResult(duration, batch_size=len(seqs))
        c = self.counters
        c.steps += 1
        c.busy_s += duration
        c.batched_requests += result.batch_size
        finished = False
        for g, seq in seqs:
            self._on_token(g, end, result)
            finished |= self._append(g, seq)
        if finished:
            self._free_finished(end, result)
        return result

    def _free_finished(self, end: float, result: StepResult) -> None:
        for g in self.sched.free_finished():
            m = self.metrics.pop(g.request_id)
            m.finish(end)
            result.finished.append(g.request_id)

    def _count(self, out: SchedulerOutput, duration: float, batch_size: int) -> None:
        c = self.counters
        c.steps += 1
        c.busy_s += duration
        c.batched_requests += batch_size
        c.prefill_tokens += sum([s.num_new_tokens for s in out.scheduled
                                 if s.num_new_tokens > 1 or s.start < s.seq.prompt_len])

    def _sample(self, out: SchedulerOutput, end: float, result: StepResult) -> None:
        sched = self.sched
        beams: dict[str, SequenceGroup] = {}
        seen: set[str] = set()
        for s in out.scheduled:
            g, seq = s.group, s.seq
            if not s.samples or seq.status is SeqStatus.FINISHED:
                continue
            rid = g.request_id
            if rid not in seen:
                seen.add(rid)
                self._on_token(g, end, result)
            if g.params.use_beam_search and g.forked:
                beams[g.request_id] = g
                continue
            if g.params.n > 1 and not g.forked:
                g.forked = True
                for _ in range(g.params.n - 1):
                    self._append(g, sched.fork(g, seq))
            self._append(g, seq)
        for g in beams.values():
            self._beam_step(g)

    def _on_token(self, g: SequenceGroup, end: float, result: StepResult) -> None:
        """The request emits a token at `end` (once per step, however many samples)."""
        result.tokens.append(g.request_id)
        m = self.metrics[g.request_id]
        if not m.token_times and g.num_cached_prompt_tokens:
            m.cached_tokens = max(m.cached_tokens, g.num_cached_prompt_tokens)
        m.on_token(end)

    def _append(self, g: SequenceGroup, seq) -> bool:
        """Append a placeholder token to `seq`; True when that finished it."""
        self.counters.generated_tokens += 1
        return self.sched.append_token(g, seq, next(self._markers))

    def _beam_step(self, g: SequenceGroup) -> None:
        """A deterministic stand-in for beam search that exercises the same machinery: the
        best beam branches in two, the worst is pruned, the others extend."""
        live = g.live_seqs
        if len(live) >= 2:
            self.sched.drop_seq(g, live[-1])
            self._append(g, self.sched.fork(g, live[0]))
        for seq in live[:-1] if len(live) >= 2 else live:
            self._append(g, seq)

    # -- views ---------------------------------------------------------------------------------
    def load(self) -> InstanceLoad:
        sched = self.sched
        queued = 0
        ctx = 0
        for g in itertools.chain(sched.waiting, sched.running):
            for seq in g.seqs:
                if seq.status is SeqStatus.FINISHED:
                    continue
                n = len(seq.token_ids)
                left = n - seq.num_computed_tokens
                if left > 1:
                    queued += left
                else:
                    ctx += n
        return InstanceLoad(
            queued_prefill_tokens=queued,
            running_decode_reqs=len(sched.running),
            free_kv_blocks=sched.kv.num_free_blocks,
            total_kv_blocks=sched.config.num_blocks,
            decode_context_tokens=ctx,
        )


def write_blocks(kv: KVCacheManager, hashes: Sequence[BlockHash]) -> int:
    """Register blocks received from elsewhere as cached, as a KV connector does after a
    copy: allocate, commit, free. Returns blocks written (0 when memory is short: the
    receiver then recomputes). Token ids are irrelevant: the hashes are given."""
    n = len(hashes)
    if n == 0 or n + 1 > kv.num_free_blocks:
        return 0
    tokens = range(n * kv.block_size + 1)  # only its length is read: every full block's hash is given
    kv.allocate(_SEED_SEQ_ID, tokens, block_hashes=hashes)
    kv.commit(_SEED_SEQ_ID, tokens, n * kv.block_size)
    kv.free(_SEED_SEQ_ID)
    return n


@dataclass(slots=True)
class InstanceRun:
    """A single-instance run: per-request metrics, the instance (for its counters and KV
    stats) and the virtual time the last request finished."""

    metrics: list[RequestMetrics]
    instance: SimInstance
    end_s: float
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (t, kv usage, batch)


def run_instance(
    requests: Sequence[SimRequest],
    scheduler_config: SchedulerConfig,
    cost_model: CostModel,
    *,
    on_step: Callable[[SimInstance, float, StepResult], None] | None = None,
    sample_every: int = 0,
    hasher: BlockHasher | None = None,
) -> InstanceRun:
    """Event-driven loop: step while there is work, jump to the next arrival when idle.
    Arrivals at or before the current instant join before the next step."""
    inst = SimInstance("i0", scheduler_config, cost_model, hasher)
    if scheduler_config.record_kv_events:
        raise ConfigError("run_instance does not drain KV events; leave record_kv_events off")
    pending = [(r.arrival_s, i, r) for i, r in enumerate(requests)]
    heapq.heapify(pending)
    all_metrics: list[RequestMetrics] = []
    run = InstanceRun(all_metrics, inst, 0.0)
    now = 0.0
    while pending or inst.has_work():
        while pending and pending[0][0] <= now:
            _, _, r = heapq.heappop(pending)
            all_metrics.append(inst.add(r, r.arrival_s))
        if not inst.has_work():
            now = max(now, pending[0][0])
            continue
        res = inst.step(now)
        if res.duration == 0.0:
            raise ConfigError(f"instance stalled at t={now:.3f}: a request can never be scheduled")
        now += res.duration
        if on_step is not None:
            on_step(inst, now, res)
        if sample_every and inst.counters.steps % sample_every == 0:
            run.samples.append((now, inst.sched.kv.usage().usage, res.batch_size))
    run.end_s = now
    return run


def simulate_offline(
    requests: Sequence[SimRequest], scheduler_config: SchedulerConfig, cost_model: CostModel
) -> InstanceRun:
    """Every request queued at t=0 (throughput-style run), for calibration against the engine."""
    return run_instance([replace(r, arrival_s=0.0) for r in requests], scheduler_config, cost_model)


def simulate_poisson(
    requests: Sequence[SimRequest], scheduler_config: SchedulerConfig, cost_model: CostModel
) -> InstanceRun:
    """Requests at their own arrival instants (a Poisson or trace workload)."""
    return run_instance(requests, scheduler_config, cost_model)
