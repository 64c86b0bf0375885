"""Prometheus metrics under `kvpool:`, one registry per app so several servers can share a process.

The engine thread updates them after every loop turn (gauges, counters from the engine's
cumulative totals) and when a request finishes (latency histograms). prometheus-client is
thread-safe, so /metrics reads them from the event loop without a lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0)


@dataclass(slots=True)
class EngineTotals:
    """The engine's cumulative counters at one instant; metrics add the difference."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


class KVStoreCollector:
    """Per-tier figures of the engine's tiered KV store, read at scrape time."""

    _COUNTERS = (
        ("hits", "hits", "Blocks found in the tier."),
        ("misses", "misses", "Blocks looked for and not found in the tier."),
        ("bytes_read", "bytes_loaded", "Bytes loaded from the tier."),
        ("bytes_written", "bytes_stored", "Bytes stored to the tier."),
        ("failed_puts", "failed_stores", "Stores the tier refused or failed (full, down)."),
        ("errors", "errors", "Tier errors (unreachable pool, I/O errors)."),
        ("load_time_s", "load_seconds", "Time spent loading from the tier."),
        ("load_count", "loads", "Loads from the tier."),
        ("store_time_s", "store_seconds", "Time spent storing to the tier."),
        ("store_count", "stores", "Stores to the tier."),
    )

    def __init__(self, engine, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def collect(self):
        connector = self._engine.kv_store
        if connector is None:
            return
        stats = connector.store.stats()
        for field, name, doc in self._COUNTERS:
            fam = CounterMetricFamily(f"kvpool:kv_store_{name}", doc, labels=["model_name", "tier"])
            for tier, st in stats.items():
                fam.add_metric([self._model, tier], float(getattr(st, field)))
            yield fam
        for field, name, doc in (("used_bytes", "used_bytes", "Bytes the tier holds."),
                                 ("capacity_bytes", "capacity_bytes", "The tier's byte budget.")):
            fam = GaugeMetricFamily(f"kvpool:kv_store_{name}", doc, labels=["model_name", "tier"])
            for tier, st in stats.items():
                fam.add_metric([self._model, tier], float(getattr(st, field)))
            yield fam
        bad = CounterMetricFamily("kvpool:kv_store_bad_entries", "Store entries that could not be a block "
                                  "(wrong type or size, not a regular file, undecodable): served as misses.",
                                  labels=["model_name", "tier", "reason"])
        for tier, st in stats.items():
            for reason, n in sorted(st.bad_entries.items()):
                bad.add_metric([self._model, tier, reason], float(n))
        yield bad
        hit = CounterMetricFamily("kvpool:kv_store_hit_tokens", "Prompt tokens loaded from the store instead of "
                                  "computed.", labels=["model_name"])
        hit.add_metric([self._model], float(self._engine.scheduler.num_external_hit_tokens))
        yield hit


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvpool:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvpool:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"kvpool:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for their (re)admission.")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.blocks_total = gauge("kv_blocks_total", "KV blocks in the device pool.")
        self.blocks_free = gauge("kv_blocks_free", "KV blocks not held by any request (cached ones included).")
        self.blocks_cached = gauge("kv_blocks_cached", "Free KV blocks that still hold a reusable prefix.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Preemptions (recompute or swap).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter("kvpool:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model = model_name
        self.aborted = counter("request_aborted", "Requests aborted (client gone, shutdown, error).")
        self.rejected = counter("request_rejected", "Requests refused because the queue was full.")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS)
        self._last = EngineTotals()

    def watch_store(self, engine) -> None:
        """Export the engine's tiered KV store (if it has one) on /metrics."""
        if engine.kv_store is not None:
            self.registry.register(KVStoreCollector(engine, self._model))

    def update(self, engine) -> None:
        """Refresh gauges and add the engine's progress since the last call (engine thread)."""
        sched = engine.scheduler
        usage = sched.kv.usage()
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.swapped.set(len(sched.swapped))
        self.kv_usage.set(usage.usage)
        self.blocks_total.set(usage.total_blocks)
        self.blocks_free.set(usage.free_blocks)
        self.blocks_cached.set(usage.cached_blocks)
        stats = sched.kv.stats
        now = EngineTotals(engine.num_prompt_tokens, engine.num_generated_tokens, sched.num_preemptions,
                           stats.queries_tokens, stats.hits_tokens)
        last = self._last
        self.prompt_tokens.inc(max(0, now.prompt_tokens - last.prompt_tokens))
        self.generation_tokens.inc(max(0, now.generation_tokens - last.generation_tokens))
        self.preemptions.inc(max(0, now.preemptions - last.preemptions))
        self.prefix_queries.inc(max(0, now.prefix_queries - last.prefix_queries))
        self.prefix_hits.inc(max(0, now.prefix_hits - last.prefix_hits))
        self._last = now

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        times = m.token_times
        for a, b in zip(times, times[1:], strict=False):
            self.itl.observe(b - a)
        reason = out.outputs[0].finish_reason if out.outputs else None
        self._success.labels(self._model, reason or "unknown").inc()
