"""A simulated cluster driven by the real `Conductor`: prefill and decode SimInstances
(or colocated ones), an optional shared KV pool, and one event queue in virtual time.

Life of a request (disaggregated): arrival -> `conductor.route` (accept or reject) ->
optional pull of cached blocks from another instance or the pool (network time) -> prefill
on the chosen instance (its own prefix cache, max_tokens=1: the first token) -> the decode
instance accepts it or rejects it (prefill wasted) -> KV transfer (network time) -> decode
on the chosen instance. `conductor.index` reads every instance's (and the pool's) cache as it
is (`GlobalKVIndex.watch`), which is what replaying their KV events in order would give: they are
drained before the next route. Their retention events feed it; every instance reports its load
after each step.

Events are processed in (time, sequence number) order, so a run is deterministic.

Fast-forward: a decode instance's steps interact with the rest of the cluster only through
arrivals (routing reads its load and cached blocks), the steps of prefill instances holding a
request bound for it (which start decodes on it, hand requests to it and read its state to
accept them), the prefill adds of such requests (which make a prefill instance hold one), its
own hand-overs and load samples. Other instances' events touch none of its state (nor does a
prefill step with no request for it: measured on the conversation trace, 3 in 4 of the events
that used to end a run). So when a decode instance steps, it takes every following plain decode
step (`SimInstance.decode_run`) that starts before the earliest pending event of those kinds
in one go, draining its KV events after each step as usual; only its last report before that
event can be read, so it reports once. Results are identical to stepping one event at a time
(`fast_forward_decode=False`; tests/sim compare the two).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from kvpool.conductor.conductor import Conductor
from kvpool.conductor.index import POOL
from kvpool.conductor.predictor import CostModelPredictor, StepTimePredictor
from kvpool.conductor.records import ConductorConfig, RouteRequest
from kvpool.core.kv_manager import KVCacheManager
from kvpool.core.receive import receive
from kvpool.costs.cost_model import CostModel
from kvpool.errors import ConfigError
from kvpool.sched.instance_load import decode_accepts
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.instance import SimInstance
from kvpool.sim.metrics import RequestMetrics
from kvpool.sim.tokens import BlockHasher, TokenSynth
from kvpool.sim.workloads import SimRequest

ARRIVE, PREFILL_ADD, DECODE_ADD, STEP, SAMPLE = range(5)


@dataclass(slots=True)
class ClusterConfig:
    """`num_decode` 0 means colocated instances. `pool_blocks` > 0 adds a shared KV pool
    (LRU over hosts' DRAM) that every prefill writes its prompt blocks to."""

    num_prefill: int
    num_decode: int
    scheduler: SchedulerConfig
    conductor: ConductorConfig
    decode_scheduler: SchedulerConfig | None = None
    pool_blocks: int = 0
    sample_interval_s: float = 0.0  # load samples for plots; 0 = none
    fast_forward_decode: bool = True  # see the module docstring; results do not change

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 0:
            raise ConfigError(f"need num_prefill >= 1 and num_decode >= 0, got {self.num_prefill}, {self.num_decode}")
        if self.conductor.block_size != self.scheduler.block_size:
            raise ConfigError(
                f"conductor block_size {self.conductor.block_size} != scheduler block_size {self.scheduler.block_size}"
            )


@dataclass(slots=True)
class LoadSample:
    t: float
    prefill_queued_tokens: list[int]
    decode_running: list[int]


@dataclass(slots=True)
class ClusterResult:
    metrics: list[RequestMetrics]
    conductor: dict
    instances: dict[str, dict]
    end_s: float
    samples: list[LoadSample] = field(default_factory=list)
    rejected_after_prefill: int = 0
    wasted_prefill_tokens: int = 0
    prefill_tokens: int = 0
    transferred_blocks: int = 0


@dataclass(slots=True)
class _Flight:
    req: SimRequest
    metrics: RequestMetrics
    hashes: list
    prefill_id: str = ""
    decode_id: str = ""
    uncached: int = 0


class SimCluster:
    def __init__(
        self,
        config: ClusterConfig,
        cost_model: CostModel,
        predictor: StepTimePredictor | None = None,
        decode_cost_model: CostModel | None = None,
    ) -> None:
        self.config = config
        self.cost_model = cost_model
        sc = config.scheduler
        self.hasher = BlockHasher(sc.block_size, TokenSynth())
        events = replace(sc, record_kv_events=True)
        self.prefill = {f"p{i}": SimInstance(f"p{i}", events, cost_model, self.hasher)
                        for i in range(config.num_prefill)}
        dsc = replace(config.decode_scheduler or sc, record_kv_events=True, namespace=sc.namespace,
                      block_size=sc.block_size)
        self.decode = {f"d{i}": SimInstance(f"d{i}", dsc, decode_cost_model or cost_model, self.hasher)
                       for i in range(config.num_decode)}
        self.instances = {**self.prefill, **self.decode}
        self.predictor = predictor or CostModelPredictor(cost_model)
        self.conductor = Conductor(list(self.prefill), list(self.decode), self.predictor, config.conductor)
        self.pool = KVCacheManager(config.pool_blocks, sc.block_size, namespace=sc.namespace) if config.pool_blocks else None
        # the caches as they are: replaying their events, which lose the order between a block's
        # eviction and its registration again, dropped blocks they held
        caches = {iid: inst.sched.kv for iid, inst in self.instances.items()}
        if self.pool is not None:
            caches[POOL] = self.pool
        for iid, kv in caches.items():
            self.conductor.index.watch(iid, kv.pool.cached_hashes())
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._busy: set[str] = set()
        self._flights: dict[str, _Flight] = {}
        self._arrivals_left = 0
        self.result = ClusterResult([], {}, {}, 0.0)
        # Pending events that can observe or change a decode instance (see fast-forward).
        self._fast_forward = config.fast_forward_decode and bool(self.decode)
        self._arrival_times: list[float] = []  # sorted; the next is at index len - _arrivals_left
        self._prefill_adds: dict[str, list[float]] = {d: [] for d in self.decode}  # heaps, by decode instance
        self._bound: dict[str, dict[str, int]] = {p: {} for p in self.prefill}  # prefill -> decode -> requests
        self._decode_adds: dict[str, list[float]] = {d: [] for d in self.decode}  # heaps
        self._prefill_steps: dict[str, float] = {}  # prefill instance -> its pending step
        self._next_sample = math.inf

    # -- the event loop -------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def run(self, requests: Sequence[SimRequest], on_arrival: Callable[[int], None] | None = None) -> ClusterResult:
        with gc_paused():
            return self._run(requests, on_arrival)

    def _run(self, requests: Sequence[SimRequest], on_arrival: Callable[[int], None] | None) -> ClusterResult:
        for r in requests:
            self._push(r.arrival_s, ARRIVE, r)
        self._arrivals_left = len(requests)
        self._arrival_times = sorted(r.arrival_s for r in requests)
        if self.config.sample_interval_s > 0 and requests:
            self._push_sample(0.0)
        now = 0.0
        while self._heap:
            now, _, kind, payload = heapq.heappop(self._heap)
            if kind == ARRIVE:
                self._arrivals_left -= 1
                self._arrive(payload, now)
                if on_arrival is not None:
                    on_arrival(1)
            elif kind == STEP:
                self._step(payload, now)
            elif kind == PREFILL_ADD:
                self._prefill_add(payload, now)
            elif kind == DECODE_ADD:
                self._decode_add(payload, now)
            elif kind == SAMPLE:
                self._next_sample = math.inf
                if self._flights or self._arrivals_left:
                    self._sample(now)
        return self._finish(now)

    def _wake(self, inst_id: str, now: float) -> None:
        if inst_id not in self._busy:
            self._busy.add(inst_id)
            self._push_step(inst_id, now)

    def _push_step(self, inst_id: str, t: float) -> None:
        if inst_id in self.prefill:
            self._prefill_steps[inst_id] = t
        self._push(t, STEP, inst_id)

    def _push_sample(self, t: float) -> None:
        self._next_sample = t
        self._push(t, SAMPLE, None)

    def _horizon(self, decode_id: str) -> float:
        """The earliest pending event that can observe or change decode instance `decode_id`:
        an arrival, a prefill add of a request bound for it, a step of a prefill instance
        holding such a request, a hand-over to it, or a load sample. No such event can be
        created before it: arrivals are all queued from the start, a prefill instance comes to
        hold a request for it only by that request's prefill add, and prefill adds, prefill
        steps and hand-overs are created only by events of those kinds."""
        t = self._next_sample
        left = self._arrivals_left
        if left:
            t = min(t, self._arrival_times[len(self._arrival_times) - left])
        adds = self._prefill_adds[decode_id]
        if adds:
            t = min(t, adds[0])
        adds = self._decode_adds[decode_id]
        if adds:
            t = min(t, adds[0])
        for p, at in self._prefill_steps.items():
            if at < t and self._bound[p].get(decode_id):
                t = at
        return t

    # -- handlers ----------------------------------------------------------------------------------
    def _arrive(self, req: SimRequest, now: float) -> None:
        m = RequestMetrics(req.request_id, req.arrival_s, req.prompt_len)
        self.result.metrics.append(m)
        hashes = self.hasher.hashes(req.chunks) if self.config.scheduler.enable_prefix_caching else []
        decision = self.conductor.route(RouteRequest(req.request_id, req.prompt_len, hashes, req.output_len), now)
        if not decision.accepted:
            m.rejected = True
            m.finish(now)
            return
        flight = _Flight(req, m, hashes, decision.prefill_id, decision.decode_id or decision.prefill_id)
        self._flights[req.request_id] = flight
        delay = 0.0
        if decision.pull_from is not None:
            delay = self.cost_model.kv_transfer_time(decision.pull_blocks)
            self.result.transferred_blocks += decision.pull_blocks
        if self._fast_forward:
            heapq.heappush(self._prefill_adds[flight.decode_id], now + delay)
        self._push(now + delay, PREFILL_ADD, (flight, decision.cached_blocks if decision.pull_from else 0))

    def _prefill_add(self, payload: tuple[_Flight, int], now: float) -> None:
        flight, pulled = payload
        if self._fast_forward:  # events run in time order: this one is the earliest
            heapq.heappop(self._prefill_adds[flight.decode_id])
        bound = self._bound[flight.prefill_id]
        bound[flight.decode_id] = bound.get(flight.decode_id, 0) + 1
        inst = self.prefill[flight.prefill_id]
        if pulled:
            inst.seed_blocks(flight.hashes[:pulled])
            self._drain(inst)
        colocated = not self.decode
        inst.add(flight.req, now, max_tokens=None if colocated else 1, prompt_hashes=flight.hashes,
                 metrics=flight.metrics)
        self._wake(inst.instance_id, now)

    def _decode_add(self, flight: _Flight, now: float) -> None:
        heapq.heappop(self._decode_adds[flight.decode_id])
        inst = self.decode[flight.decode_id]
        inst.seed_blocks(flight.hashes)
        self._drain(inst)
        inst.add(flight.req, now, max_tokens=flight.req.output_len - 1, extra_prompt_tokens=1,
                 prompt_hashes=flight.hashes, metrics=flight.metrics)
        self._wake(inst.instance_id, now)

    def _step(self, inst_id: str, now: float) -> None:
        inst = self.instances[inst_id]
        self._prefill_steps.pop(inst_id, None)
        if self._fast_forward and inst_id in self.decode:
            end = self._decode_run(inst, now)
            if end is not None:
                self._push(end, STEP, inst_id)
                return
        before = inst.counters.prefill_tokens
        res = inst.step(now)
        if res.duration == 0.0:
            self._busy.discard(inst_id)
            if inst.has_work():
                raise ConfigError(f"instance {inst_id} stalled at t={now:.3f}: a request can never be scheduled")
            return
        end = now + res.duration
        self.result.prefill_tokens += inst.counters.prefill_tokens - before
        self._drain(inst)
        self.conductor.update_load(inst_id, inst.load())
        is_prefill = inst_id in self.prefill
        for rid in res.tokens:
            flight = self._flights[rid]
            if is_prefill and len(flight.metrics.token_times) == 1:
                self.conductor.on_prefill_done(rid, end)
        for rid in res.finished:
            flight = self._flights[rid]
            if is_prefill:
                self._bound[inst_id][flight.decode_id] -= 1
            if is_prefill and self.decode and flight.req.output_len > 1:
                self._hand_over(flight, end)
            else:
                self._flights.pop(rid)
                self.conductor.on_decode_done(rid, end, output_tokens=flight.metrics.output_len)
        self._push_step(inst_id, end)

    def _decode_run(self, inst: SimInstance, now: float) -> float | None:
        """Fast-forward decode instance `inst` (see the module docstring): each step exactly as
        `_step` takes it, except that only the load report before a finish and the last one are
        made. Returns when the next step is due, or None when not even the first step is plain."""
        inst_id = inst.instance_id
        end = None
        reported = False
        for res in inst.decode_run(now, self._horizon(inst_id)):
            end = res.end
            self._drain(inst)
            reported = bool(res.finished)
            if reported:
                self.conductor.update_load(inst_id, inst.load())
                for rid in res.finished:
                    flight = self._flights.pop(rid)
                    self.conductor.on_decode_done(rid, end, output_tokens=flight.metrics.output_len)
        if end is not None and not reported:
            self.conductor.update_load(inst_id, inst.load())
        return end

    def _hand_over(self, flight: _Flight, now: float) -> None:
        """Prefill done: the decode instance takes the request (KV transfer) or refuses it."""
        req = flight.req
        if self.pool is not None and flight.hashes:
            receive(self.pool, flight.hashes)  # the index watches the pool: no events to drain
        dec = self.decode[flight.decode_id]
        if not decode_accepts(dec.sched, req.prompt_len, req.output_len, self.config.conductor.tbt_slo_s,
                              self.predictor.decode_step_time):
            self._flights.pop(req.request_id)
            wasted = req.prompt_len - flight.metrics.cached_tokens
            self.conductor.on_rejected_after_prefill(req.request_id, wasted)
            self.result.rejected_after_prefill += 1
            self.result.wasted_prefill_tokens += wasted
            flight.metrics.rejected = True
            return
        blocks = -(-req.prompt_len // self.config.scheduler.block_size)
        self.result.transferred_blocks += blocks
        at = now + self.cost_model.kv_transfer_time(blocks)
        heapq.heappush(self._decode_adds[flight.decode_id], at)
        self._push(at, DECODE_ADD, flight)

    def _drain(self, inst: SimInstance) -> None:
        if not inst.sched.kv.pool.has_events:
            return
        ev = inst.sched.kv.drain_events()  # the index watches the cache: retention, and evictions ending one, are news to it
        if ev.retention:  # in virtual time, the conductor's clock
            self.conductor.index.on_retention(inst.instance_id, ev.retention)
        if ev.evicted:
            self.conductor.index.on_evicted(inst.instance_id, ev.evicted)

    def _sample(self, now: float) -> None:
        self.result.samples.append(LoadSample(
            now,
            [self.conductor.queued_prefill_tokens(p) for p in self.prefill],
            [len(d.sched.running) for d in (self.decode or self.prefill).values()],
        ))
        self._push_sample(now + self.config.sample_interval_s)

    def _finish(self, now: float) -> ClusterResult:
        r = self.result
        r.end_s = now
        r.conductor = self.conductor.snapshot(now)["stats"]
        for iid, inst in self.instances.items():
            c = inst.counters
            r.instances[iid] = {
                "steps": c.steps, "busy_s": c.busy_s, "prefill_tokens": c.prefill_tokens,
                "generated_tokens": c.generated_tokens, "prefix_hit_rate": inst.sched.kv.stats.hit_rate,
                "mean_batch": c.batched_requests / max(c.steps, 1), "preemptions": inst.sched.num_preemptions,
            }
        return r


@contextmanager
def gc_paused() -> Iterator[None]:
    """Turn off the cyclic garbage collector for a run (restored after, nesting allowed). The
    event loop makes millions of long-lived objects (block hashes, token and block lists) and
    no reference cycles, so the collector's passes over a growing heap (7% of a trace-length
    run) reclaim nothing."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

