"""Prometheus metrics under `kvpool:` (or `--metrics-prefix`), one registry per app so several
servers can share a process.

Names after the prefix, types and buckets follow vLLM's, so `--metrics-prefix vllm` makes
vLLM's Grafana dashboards work unchanged; kvpool's own extras (KV block gauges, tiered store)
sit beside them. The engine thread updates them after every loop turn (gauges, counters from
the engine's cumulative totals) and when a request finishes (per-request histograms).
prometheus-client is thread-safe, so /metrics reads them from the event loop without a lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool.engine.outputs import RequestMetrics, RequestOutput
from kvpool.serve.http_metrics import HTTPMetrics, add_process_collectors
from kvpool.serve.recorder import RequestRecorder

# vLLM's buckets, so its dashboards' quantiles mean the same here
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


_PREEMPTION_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100)
# a phase of the TTFT breakdown: finer than vLLM's latency buckets at the low end (a phase is often < 1 ms)
_PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06,
                  0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# where a request's time to first token goes, in order (docs/serving.md, Metrics)
TTFT_PHASES = ("receive", "tokenize", "admit", "queue", "schedule", "prefill_compute", "sample", "postprocess", "detokenize",
               "deliver")


def _host_tier_usage(engine) -> float:
    """Used fraction of the tiered store's host tier, the CPU cache vLLM's dashboard plots."""
    connector = engine.kv_store
    tiers = connector.store.tiers if connector is not None else ()
    host = next((t.stats() for t in tiers if t.name == "host"), None)  # in-process counters: cheap
    return host.used_bytes / host.capacity_bytes if host is not None and host.capacity_bytes else 0.0


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class EngineTotals:
    """The engine's cumulative counters at one instant; metrics add the difference."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    external_hits: int = 0  # prompt tokens loaded from the tiered store (a high-water mark)


class KVStoreCollector:
    """Per-tier figures of the engine's tiered KV store, read at scrape time."""

    _COUNTERS = (
        ("hits", "hits", "Blocks found in the tier."),
        ("misses", "misses", "Blocks looked for and not found in the tier."),
        ("bytes_read", "bytes_loaded", "Bytes loaded from the tier."),
        ("bytes_written", "bytes_stored", "Bytes stored to the tier."),
        ("failed_puts", "failed_stores", "Stores the tier refused or failed (full, down)."),
        ("errors", "errors", "Tier errors (unreachable pool, I/O errors)."),
        ("lossy_loads", "lossy_loads", "Blocks served quantized by the tier's lossy codec (int8 / int4)."),
        ("load_time_s", "load_seconds", "Time spent loading from the tier."),
        ("load_count", "loads", "Loads from the tier."),
        ("store_time_s", "store_seconds", "Time spent storing to the tier."),
        ("store_count", "stores", "Stores to the tier."),
        ("pinned_evictions", "pinned_evictions", "Retained blocks the tier evicted because nothing else could go."),
        ("retention_applied", "retention_applied", "Retentions a remote pool was told of (begun or lapsed: Redis "
         "PERSIST / expiry back, a Mooncake soft pin set or dropped)."),
        ("retention_unhonoured", "retention_unhonoured", "Retained blocks met in a remote pool whose eviction ignores "
         "retention (Redis allkeys-*, a soft pin the Mooncake master refused)."),
    )

    def __init__(self, engine, model_name: str, prefix: str = "kvpool") -> None:
        self._engine = engine
        self._model = model_name
        self._prefix = prefix

    def collect(self):
        connector = self._engine.kv_store
        if connector is None:
            return
        stats = connector.store.stats()
        for field, name, doc in self._COUNTERS:
            fam = CounterMetricFamily(f"{self._prefix}:kv_store_{name}", doc, labels=["model_name", "tier"])
            for tier, st in stats.items():
                fam.add_metric([self._model, tier], float(getattr(st, field)))
            yield fam
        for field, name, doc in (("used_bytes", "used_bytes", "Bytes the tier holds."),
                                 ("capacity_bytes", "capacity_bytes", "The tier's byte budget."),
                                 ("read_latency_s", "read_latency_seconds", "Online estimate of one read's fixed "
                                  "cost, checks included (0: not measured); the load-or-recompute planner's input."),
                                 ("read_bandwidth", "read_bandwidth_bytes", "Online estimate of the tier's read "
                                  "bandwidth in bytes/s, checks included (0: not measured).")):
            fam = GaugeMetricFamily(f"{self._prefix}:kv_store_{name}", doc, labels=["model_name", "tier"])
            for tier, st in stats.items():
                fam.add_metric([self._model, tier], float(getattr(st, field)))
            yield fam
        bad = CounterMetricFamily(f"{self._prefix}:kv_store_bad_entries", "Store entries that could not be a block "
                                  "(wrong type or size, not a regular file, undecodable): served as misses.",
                                  labels=["model_name", "tier", "reason"])
        for tier, st in stats.items():
            for reason, n in sorted(st.bad_entries.items()):
                bad.add_metric([self._model, tier, reason], float(n))
        yield bad
        hit = CounterMetricFamily(f"{self._prefix}:kv_store_hit_tokens", "Prompt tokens loaded from the store instead of "
                                  "computed.", labels=["model_name"])
        hit.add_metric([self._model], float(self._engine.scheduler.num_external_hit_tokens))
        yield hit


class ServerMetrics:
    def __init__(self, model_name: str, prefix: str = "kvpool", max_model_len: int = 2048) -> None:
        self.registry = CollectorRegistry()
        self.prefix = prefix
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{prefix}:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for their (re)admission.")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.blocks_total = gauge("kv_blocks_capacity", "KV blocks in the device pool.")
        self.blocks_free = gauge("kv_blocks_free", "KV blocks not held by any request (cached ones included).")
        self.blocks_cached = gauge("kv_blocks_cached", "Free KV blocks that still hold a reusable prefix.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Preemptions (recompute or swap).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter(f"{prefix}:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model = model_name
        self.aborted = counter("request_aborted", "Requests aborted (client gone, shutdown, error).")
        self.rejected = counter("request_rejected", "Requests refused because the queue was full.")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request.", _TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time in the engine's waiting queue: taken by "
                                    "the engine thread to first scheduled (vLLM's meaning).", _REQUEST_BUCKETS)
        self._add_request_metrics(histogram, counter, max_model_len)
        breakdown = Histogram(f"{prefix}:ttft_breakdown_seconds", "A request's time to first token by phase: "
                              "receive (its HTTP request read and parsed), tokenize (to submission), admit (to the engine thread taking it), queue (to "
                              "its first step), schedule / prefill_compute / sample / postprocess / detokenize (the "
                              "steps until its first token), deliver (to its first chunk written).",
                              ["model_name", "phase"], buckets=_PHASE_BUCKETS, registry=r)
        self._phases = [breakdown.labels(model_name, phase) for phase in TTFT_PHASES]
        self._add_vllm_extras(gauge, counter, histogram, max_model_len)
        self._kv_source = Counter(f"{prefix}:prompt_tokens_by_kv_source", "Prompt tokens of finished requests "
                                  "whose KV was reused, by where: device (prefix cache) or a store tier's name.",
                                  ["model_name", "source"], registry=r)
        self._kv_missed = Counter(f"{prefix}:prompt_tokens_missed", "Prompt tokens of finished requests whose KV was "
                                  "computed, by why it was not reused (kvpool/core/miss_reasons.py).",
                                  ["model_name", "reason"], registry=r)
        self.recorder: RequestRecorder | None = None  # `kvpool serve --record-requests`
        add_process_collectors(r)
        self.http = HTTPMetrics(r)
        self._waiting_by_reason = Gauge(
            f"{prefix}:num_requests_waiting_by_reason",
            "Waiting requests by why they wait: capacity (KV blocks or batch slots) or deferred (KV still loading).",
            ["model_name", "reason"], registry=r,
        )
        self._last = EngineTotals()

    def _add_request_metrics(self, histogram, counter, max_model_len: int) -> None:
        """vLLM's per-request histograms (observed when a request finishes) and per-step counters."""
        counts = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of a finished request.", counts)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens a finished request generated (all its sequences).", counts)
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Most tokens one sequence of a finished request generated.", counts)
        self.request_params_n = histogram("request_params_n", "The n parameter of finished requests.", _N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens parameter of finished requests.", counts)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduling to first token (prefill phase).", _REQUEST_BUCKETS)
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token (decode phase).", _REQUEST_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduling to last token (running phase).", _REQUEST_BUCKETS)
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds", "A request's decode time over its tokens after the first.",
            _TOKEN_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Prompt plus generated tokens of one engine step.", _ITERATION_BUCKETS)
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Prompt tokens of finished requests whose KV was reused (prefix cache or store).")

    def _add_vllm_extras(self, gauge, counter, histogram, max_model_len: int) -> None:
        """vLLM's external-cache and by-source counters, per-request preemptions and computed
        prefill tokens, and the older names vLLM's example Grafana dashboard still plots."""
        r, prefix = self.registry, self.prefix
        self.external_queries = counter(
            "external_prefix_cache_queries", "Prompt tokens of requests admitted with the tiered KV store to look in.")
        self.external_hits = counter("external_prefix_cache_hits", "Prompt tokens loaded from the tiered KV store.")
        self._by_source = Counter(f"{prefix}:prompt_tokens_by_source", "Prompt tokens by where their KV came from: "
                                  "local_compute, local_cache_hit (device prefix cache), external_kv_transfer (store).",
                                  ["model_name", "source"], registry=r)
        self._cached_by_source = Counter(f"{prefix}:prompt_tokens_cached_by_source", "Prompt tokens whose KV was "
                                         "reused, by source: local_cache_hit, external_kv_transfer.",
                                         ["model_name", "source"], registry=r)
        self.request_preemptions = histogram("request_num_preemptions", "Times a finished request was preempted.",
                                             _PREEMPTION_BUCKETS)
        self.request_kv_computed = histogram(
            "request_prefill_kv_computed_tokens", "Prompt tokens of a finished request whose KV was computed "
            "(not reused from a cache).", buckets_1_2_5(max_model_len))
        self.gpu_cache_usage = gauge("gpu_cache_usage_perc", "vLLM's older name of kv_cache_usage_perc.")
        self.cpu_cache_usage = gauge("cpu_cache_usage_perc", "Fraction of the host KV tier in use (0 without one).")
        self.tpot_old = histogram("time_per_output_token_seconds", "vLLM's older name of inter_token_latency_seconds.",
                                  _TOKEN_BUCKETS)
        self._preempted: dict[str, int] = {}  # live request id -> preemptions, rebuilt every update

    @classmethod
    def for_engine(cls, engine, model_name: str, prefix: str = "kvpool") -> ServerMetrics:
        """Metrics sized for the engine (token-count buckets up to its context), with its cache
        configuration as `cache_config_info` and its tiered store, if any."""
        metrics = cls(model_name, prefix, engine.max_model_len)
        cfg, sched = engine.config, engine.scheduler.config
        info = Gauge(f"{prefix}:cache_config_info", "Information of the engine's KV cache configuration.",
                     ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "num_cpu_blocks",
                      "eviction_policy", "preemption_mode", "engine", "kv_cache_dtype"], registry=metrics.registry)
        info.labels(str(sched.block_size), cfg.dtype, str(cfg.enable_prefix_caching), str(sched.num_blocks),
                    str(sched.num_host_blocks), cfg.eviction_policy, cfg.preemption_mode, "0",
                    getattr(engine, "kv_dtype", cfg.dtype)).set(1)
        metrics.watch_store(engine)
        return metrics

    def watch_store(self, engine) -> None:
        """Export the engine's tiered KV store (if it has one) on /metrics."""
        if engine.kv_store is not None:
            self.registry.register(KVStoreCollector(engine, self._model, self.prefix))

    def update(self, engine) -> None:
        """Refresh gauges and add the engine's progress since the last call (engine thread)."""
        sched = engine.scheduler
        usage = sched.kv.usage()
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        deferred = sum(1 for g in sched.waiting if g.pending_kv_loads)
        self._waiting_by_reason.labels(self._model, "capacity").set(len(sched.waiting) - deferred)
        self._waiting_by_reason.labels(self._model, "deferred").set(deferred)
        self.swapped.set(len(sched.swapped))
        self.kv_usage.set(usage.usage)
        self.gpu_cache_usage.set(usage.usage)
        self.cpu_cache_usage.set(_host_tier_usage(engine))
        self._preempted = {g.request_id: g.num_preemptions
                           for queue in (sched.running, sched.waiting, sched.swapped) for g in queue
                           if getattr(g, "num_preemptions", 0)}
        self.blocks_total.set(usage.total_blocks)
        self.blocks_free.set(usage.free_blocks)
        self.blocks_cached.set(usage.cached_blocks)
        stats = sched.kv.stats
        last = self._last
        now = EngineTotals(engine.num_prompt_tokens, engine.num_generated_tokens, sched.num_preemptions,
                           stats.queries_tokens, stats.hits_tokens,
                           max(last.external_hits, sched.num_external_hit_tokens))
        step_prompt = max(0, now.prompt_tokens - last.prompt_tokens)
        step_generated = max(0, now.generation_tokens - last.generation_tokens)
        if step_prompt + step_generated:  # one engine step per loop turn at most
            self.iteration_tokens.observe(step_prompt + step_generated)
        self.prompt_tokens.inc(step_prompt)
        self.generation_tokens.inc(step_generated)
        self.preemptions.inc(max(0, now.preemptions - last.preemptions))
        self.prefix_queries.inc(max(0, now.prefix_queries - last.prefix_queries))
        self.prefix_hits.inc(max(0, now.prefix_hits - last.prefix_hits))
        self._count_sources(engine, last, now)
        self._last = now

    def _count_sources(self, engine, last: EngineTotals, now: EngineTotals) -> None:
        """Split the prompt tokens looked up since the last update by where their KV came from."""
        queried = max(0, now.prefix_queries - last.prefix_queries)
        local = max(0, now.prefix_hits - last.prefix_hits)
        external = now.external_hits - last.external_hits
        if engine.kv_store is not None:
            self.external_queries.inc(queried)
        self.external_hits.inc(external)
        for source, n in (("local_compute", max(0, queried - local - external)), ("local_cache_hit", local),
                          ("external_kv_transfer", external)):
            self._by_source.labels(self._model, source).inc(n)
        self._cached_by_source.labels(self._model, "local_cache_hit").inc(local)
        self._cached_by_source.labels(self._model, "external_kv_transfer").inc(external)

    def observe_finished(self, out: RequestOutput, generated: list[int]) -> None:
        """A finished request's latencies, sizes and parameters (`out`: its last record;
        `generated`: the tokens each of its outputs got, over all its records)."""
        m = out.metrics
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - (m.arrival_time if m.added_s is None else m.added_s))
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        times = m.token_times
        for a, b in zip(times, times[1:], strict=False):
            self.itl.observe(b - a)
            self.tpot_old.observe(b - a)
        self.request_preemptions.observe(self._preempted.pop(out.request_id, 0))
        self.request_kv_computed.observe(max(0, len(out.prompt_token_ids) - out.num_cached_tokens))
        reason = out.outputs[0].finish_reason if out.outputs else None
        self._success.labels(self._model, reason or "unknown").inc()
        self._observe_request(out, generated)

    def observe_first_token(self, m: RequestMetrics, received: float, submitted: float, delivered: float) -> None:
        """One request's TTFT breakdown, once its first token is written (event loop): `received`,
        `submitted` and `delivered` are the front's instants, the rest its engine record's."""
        p, added, first = m.phases, m.added_s, m.first_token_time
        if p is None or added is None or first is None:
            return
        for hist, value in zip(self._phases, (
                m.arrival_s - received, submitted - m.arrival_s, added - submitted, p.queued, p.schedule, p.prefill_compute, p.sample,
                p.postprocess, p.detokenize, delivered - first), strict=True):
            hist.observe(max(0.0, value))

    def _observe_request(self, out: RequestOutput, generated: list[int]) -> None:
        m = out.metrics
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(sum(generated))
        self.request_max_generation_tokens.observe(max(generated, default=0))
        self.request_params_n.observe(m.n_param)
        if m.max_tokens_param:
            self.request_params_max_tokens.observe(m.max_tokens_param)
        self.prompt_tokens_cached.inc(out.num_cached_tokens)
        split = m.prompt_sources
        if split is not None:
            for source, n in split.sources.items():
                self._kv_source.labels(self._model, source).inc(n)
            for reason, n in split.misses.items():
                self._kv_missed.labels(self._model, reason).inc(n)
        if self.recorder is not None:
            self.recorder.record(out)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            decode = m.last_token_time - m.first_token_time
            self.decode_time.observe(decode)
            longest = max(generated, default=0)
            self.request_tpot.observe(decode / (longest - 1) if longest > 1 else 0.0)
        if m.first_scheduled_time is not None and m.last_token_time is not None:
            self.inference_time.observe(m.last_token_time - m.first_scheduled_time)
