"""One simulated engine instance: the real Scheduler driven by a cost model and a virtual clock.

`SimInstance.step(now)` is `Engine.step()` with the model replaced by `CostModel.step_time`:
`schedule()`, cost the batch (new tokens, context lengths, block copies and swaps), draw
placeholder tokens, `postprocess()` (which forks, steps beams, checks stops and frees). Policies
all live in the scheduler and the KV manager; nothing here decides who runs or what a request
becomes. `decode_run` takes the commonest step, a plain decode step
(`Scheduler.plain_decode`), with the same results but without building a schedule, for
drivers that step many times between changes.

With a `SimStore` (a host, disk or remote tier) the scheduler plans store hits past the device
prefix cache as `KVLoad`s, exactly as for the engine's store, as far as loading beats recomputing
them (the engine's planner); they land when the step ends (the engine's `complete_loads()`), and
`StoreReads` prices them as the engine reads them (whole-block or layer-wise).

Beam search runs the core's `BeamSearch` on candidates from a seeded stand-in for the model:
each beam offers continuations whose logprobs fall by Exp(1) draws, so beams with better
histories branch and the others are pruned, as a language model's beams do.

Token ids: prompts are `[marker] * prompt_len` with a marker unique to the request, and
their full-block hashes are given precomputed (from the workload's chunks), so prefix reuse
is exact for full prompt blocks. Blocks filled later (the partial prompt tail plus output)
hash from unique placeholder tokens: they never collide across requests.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from kvpool.core.hashing import BlockHash
from kvpool.core.receive import receive
from kvpool.costs.cost_model import CostModel, StepBatch
from kvpool.errors import ConfigError
from kvpool.sched.beam import beam_candidates
from kvpool.sched.decode_batch import DecodeBatch
from kvpool.sched.decode_leap import leap, leap_steps
from kvpool.sched.instance_load import InstanceLoad, load_report
from kvpool.sched.output import Sample, ScheduledSeq
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpool.sim.metrics import RequestMetrics
from kvpool.sim.sim_store import SimStore, StoreReads
from kvpool.sim.tokens import BlockHasher, TokenSynth, name_blocks
from kvpool.sim.workloads import SimPin, SimRequest

_MARKER_BASE = 1 << 48  # placeholder token ids, above any vocabulary


@dataclass(slots=True)
class StepResult:
    """What one step did: its duration and the requests that emitted a token or finished. A
    result of `decode_run` also says when it ended (`end`) and may cover several steps (a leap;
    `tokens` is then left empty: every request of the batch emitted one token per step)."""

    duration: float
    tokens: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    batch_size: int = 0
    end: float = math.nan
    steps: int = 1
    loads: int = 0  # store loads planned (a layer-wise load's planning step may take no time)


@dataclass(slots=True)
class InstanceCounters:
    steps: int = 0
    busy_s: float = 0.0
    batched_requests: int = 0  # summed over steps (mean = / steps)
    prefill_tokens: int = 0  # prompt tokens computed (recomputation included)
    generated_tokens: int = 0
    loaded_blocks: int = 0  # from the store tier


class SimInstance:
    """An engine instance in virtual time. `step(now)` runs one iteration and returns its
    duration; the driver advances the clock."""

    def __init__(
        self,
        instance_id: str,
        config: SchedulerConfig,
        cost_model: CostModel,
        hasher: BlockHasher | None = None,
        store: SimStore | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.sched = Scheduler(config, external_kv=store.lookup if store is not None else None)
        self.sched.kv.name_blocks = name_blocks  # placeholder tokens: see `name_blocks`
        self.store = store
        self.reads = StoreReads(store, self.sched, cost_model) if store is not None else None
        self.cost_model = cost_model
        self.hasher = hasher or BlockHasher(config.block_size, TokenSynth())
        self.metrics: dict[str, RequestMetrics] = {}
        self.counters = InstanceCounters()
        self._markers = itertools.count(_MARKER_BASE)
        self._beam_rng = random.Random(f"beams/{instance_id}")
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
        seq = self.sched.new_sequence(itertools.repeat(next(self._markers), prompt_len))  # one list, built by the core
        width = max(req.n, req.beam_width)
        params = SamplingParams(
            n=width, max_tokens=max_tokens or req.output_len, ignore_eos=True,
            use_beam_search=req.beam_width > 1, retention=req.retention,
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
        return receive(self.sched.kv, hashes)

    # -- the step ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.sched.has_unfinished()

    def step(self, now: float) -> StepResult:
        sched = self.sched
        out = sched.schedule(now)  # virtual time: what retention TTLs expire against
        scheduled = out.scheduled
        reads = self.reads
        if not scheduled and not out.kv_loads and not (reads is not None and reads.staged):
            return StepResult(0.0)
        batch = StepBatch(
            [s.num_new_tokens for s in scheduled],
            [s.start + s.num_new_tokens for s in scheduled],
            blocks_copied=len(out.copies),
            blocks_swapped_in=len(out.swap_in),
            blocks_swapped_out=len(out.swap_out),
            idle_s=now - self._last_end,
        )
        if out.kv_loads:
            self._plan_loads(out, batch)
        duration = reads.step_time(batch) if reads is not None else self.cost_model.step_time(batch)
        end = self._last_end = now + duration
        result = StepResult(duration, batch_size=len({id(s.group) for s in scheduled}), loads=len(out.kv_loads))
        self._count(out, duration, result.batch_size)
        rows = out.sampling
        seen: set[str] = set()
        for s in rows:
            rid = s.group.request_id
            if rid not in seen:
                seen.add(rid)
                self._on_token(s.group, end, result)
        self._finished(sched.postprocess(out, [self._draw(s) for s in rows]), end, result)
        for load in out.kv_loads:  # landed with the step, as the engine's complete_loads() reports them
            if sched.kv_load_valid(load):
                sched.finish_kv_load(load, len(load.hashes))
                reads.landed(len(load.hashes))
        return result

    def _plan_loads(self, out: SchedulerOutput, batch: StepBatch) -> None:
        """Count the step's store loads and cost them as the store is read (`StoreReads`)."""
        assert self.reads is not None, "the scheduler planned loads without a store"
        loaded = sum(len(ld.hashes) for ld in out.kv_loads)
        self.counters.loaded_blocks += loaded
        self.reads.planned(batch, loaded)

    def decode_run(self, now: float, until: float) -> Iterator[StepResult]:
        """Plain decode steps (`kvpool.sched.decode_batch`) from `now` while each starts before
        `until` (the first always runs): the very steps `step()` would take, with the same
        results, but without building a schedule per step. Steps in which no request can finish
        are taken together (`kvpool.sched.decode_leap`) and yielded as one result; the others
        one by one. Ends at the first step that is not plain (or takes no time, or follows a
        pause), which `step()` then takes."""
        if now > self._last_end:  # the instance was idle: the step's cost depends on the pause
            return
        first = True
        while True:
            batch = self.sched.plain_decode()
            if batch is None:
                return
            # each step's cost depends only on its context lengths
            durations, ends = self._plain_decode_times([len(seq.token_ids) for _, seq in batch.seqs], now, until,
                                                       batch.steps, int(first))
            first = first and not ends
            cut = len(ends) < batch.steps  # by the horizon or a step that takes no time
            k = min(len(ends), leap_steps(batch))
            if k > 1:
                yield self._leap(batch, durations[:k], ends[:k])
                now = ends[k - 1]
            else:
                k = 0
            for duration, end in zip(durations[k:], ends[k:], strict=True):
                result = self._decode_step(batch, duration, end)
                now = end
                yield result
                if result.finished:
                    cut = cut and end == ends[-1]  # a finish before the last step: go on from there
                    break
            if cut:
                return

    def _leap(self, batch: DecodeBatch, durations: list[float], ends: list[float]) -> StepResult:
        """`_decode_step` for each of these steps at once (none can finish a request)."""
        seqs = batch.seqs
        b, k = len(seqs), len(ends)
        base = next(self._markers)  # the placeholder tokens _decode_step would draw, step by step
        self._markers = itertools.count(base + k * b)
        leap(batch, k, range(base, base + k * b))
        c = self.counters
        for duration in durations:  # summed in step order: the same float as step by step
            c.busy_s += duration
        c.steps += k
        c.batched_requests += k * b
        metrics = self.metrics
        for g, _ in seqs:
            m = metrics[g.request_id]
            if not m.token_times and g.num_cached_prompt_tokens:
                m.cached_tokens = max(m.cached_tokens, g.num_cached_prompt_tokens)
            m.token_times.extend(ends)
        self._last_end = ends[-1]
        c.generated_tokens = self.sched.num_generated_tokens
        return StepResult(sum(durations), batch_size=b, end=ends[-1], steps=k)

    def _plain_decode_times(self, lens: list[int], start: float, until: float, most: int,
                            least: int) -> tuple[list[float], list[float]]:
        """Durations and end times of a plain decode run's steps from `start` over these context
        lengths (each i longer at step i), while a step starts before `until` (the first `least`
        regardless) and takes time: the cost model's shortcut when it has one
        (`RooflineCostModel.plain_decode_steps`, from the batch size and the contexts' sum), else
        `step_time` per step."""
        shortcut = getattr(self.cost_model, "plain_decode_steps", None)
        if shortcut is not None:
            return shortcut(len(lens), sum(lens), start, until, most, least)
        durations: list[float] = []
        ends: list[float] = []
        ones = [1] * len(lens)
        t = start
        for i in range(most):
            if i >= least and t >= until:
                break
            duration = self.cost_model.step_time(StepBatch(ones, [n + i for n in lens]))
            if duration == 0.0:
                break
            t += duration
            durations.append(duration)
            ends.append(t)
        return durations, ends

    def _decode_step(self, batch: DecodeBatch, duration: float, end: float) -> StepResult:
        """`step()` for a plain decode batch."""
        self._last_end = end
        seqs = batch.seqs
        result = StepResult(duration, batch_size=len(seqs), end=end)
        c = self.counters
        c.steps += 1
        c.busy_s += duration
        c.batched_requests += result.batch_size
        for g, _ in seqs:
            self._on_token(g, end, result)
        markers = self._markers
        self._finished(batch.step([next(markers) for _ in seqs]), end, result)
        return result

    def _finished(self, groups: list[SequenceGroup], end: float, result: StepResult) -> None:
        self.counters.generated_tokens = self.sched.num_generated_tokens
        for g in groups:
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

    def _draw(self, s: ScheduledSeq) -> Sample:
        """Placeholder tokens for a sampling row (unique ids, so generated blocks never collide);
        for a beam, its continuations from the seeded stand-in, best first."""
        markers = self._markers
        if s.group.beam is None:
            return Sample([next(markers) for _ in range(s.num_samples)])
        draw = self._beam_rng.expovariate
        lp = 0.0
        candidates = []
        for _ in range(beam_candidates(s.group)):
            lp -= draw(1.0)
            candidates.append((next(markers), lp))
        return Sample(candidates=candidates)

    def _on_token(self, g: SequenceGroup, end: float, result: StepResult) -> None:
        """The request emits a token at `end` (once per step, however many samples)."""
        result.tokens.append(g.request_id)
        m = self.metrics[g.request_id]
        if not m.token_times and g.num_cached_prompt_tokens:
            m.cached_tokens = max(m.cached_tokens, g.num_cached_prompt_tokens)
        m.on_token(end)

    # -- views ---------------------------------------------------------------------------------
    def load(self) -> InstanceLoad:
        return load_report(self.sched)


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
    store: SimStore | None = None,
    pins: Sequence[SimPin] = (),
) -> InstanceRun:
    """Event-driven loop: step while there is work, jump to the next arrival when idle.
    Arrivals (and `pins`, first at equal times) at or before the current instant join before
    the next step."""
    inst = SimInstance("i0", scheduler_config, cost_model, hasher, store)
    if scheduler_config.record_kv_events:
        raise ConfigError("run_instance does not drain KV events; leave record_kv_events off")
    pending: list[tuple[float, int, SimRequest | SimPin]] = [(r.arrival_s, i, r) for i, r in enumerate(requests)]
    pending += [(p.at_s, i - len(pins), p) for i, p in enumerate(pins)]
    heapq.heapify(pending)
    all_metrics: list[RequestMetrics] = []
    run = InstanceRun(all_metrics, inst, 0.0)
    now = 0.0
    while pending or inst.has_work():
        while pending and pending[0][0] <= now:
            _, _, r = heapq.heappop(pending)
            if isinstance(r, SimPin):
                r.apply(inst.sched.kv, inst.hasher)
            else:
                all_metrics.append(inst.add(r, r.arrival_s))
        if not inst.has_work():
            if not pending:  # only pins were left
                break
            now = max(now, pending[0][0])
            continue
        res = inst.step(now)
        if res.duration == 0.0 and not res.loads:
            raise ConfigError(f"instance stalled at t={now:.3f}: a request can never be scheduled")
        now += res.duration
        run.end_s = now
        if on_step is not None:
            on_step(inst, now, res)
        if sample_every and inst.counters.steps % sample_every == 0:
            run.samples.append((now, inst.sched.kv.usage().usage, res.batch_size))
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
