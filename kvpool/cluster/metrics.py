"""Prometheus view of the gateway, read at scrape time from the poller, conductor and relay
counters (so it can never drift from /cluster)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.cluster.members import MemberPoller
from kvpool.cluster.relay import RelayStats
from kvpool.conductor.conductor import Conductor
from kvpool.conductor.index import POOL
from kvpool.conductor.pins import PinBook

P = "kvpool_conductor:"


class GatewayCollector(Collector):
    def __init__(self, poller: MemberPoller, conductor: Conductor, stats: RelayStats, pins: PinBook) -> None:
        self.poller, self.conductor, self.stats, self.pins = poller, conductor, stats, pins

    def collect(self) -> Iterator:
        s, c = self.stats, self.conductor
        now = time.monotonic()
        labels = ["instance", "role"]
        gauges = {
            "instance_up": GaugeMetricFamily(P + "instance_up", "1 while the instance answers polls.", labels=labels),
            "queued": GaugeMetricFamily(P + "queued_prefill_tokens",
                                        "The conductor's estimate of the instance's prefill queue.", labels=labels),
            "running": GaugeMetricFamily(P + "running_requests", "Running requests (last report).", labels=labels),
            "free": GaugeMetricFamily(P + "free_kv_blocks", "Free KV blocks (last report).", labels=labels),
            "indexed": GaugeMetricFamily(P + "indexed_blocks", "Blocks the index credits to it.", labels=labels),
            "retained": GaugeMetricFamily(P + "retained_blocks", "Of those, blocks it holds under a live "
                                          "retention (a pin or a cache_control TTL).", labels=labels),
        }
        for m in self.poller.members.values():
            key = [m.instance_id, m.role]
            gauges["instance_up"].add_metric(key, 1.0 if m.up else 0.0)
            gauges["queued"].add_metric(key, c.queued_prefill_tokens(m.instance_id))
            gauges["running"].add_metric(key, m.load.get("running", 0))
            gauges["free"].add_metric(key, m.load.get("free_kv_blocks", 0))
            gauges["indexed"].add_metric(key, c.index.num_blocks(m.instance_id))
            gauges["retained"].add_metric(key, c.index.num_retained(m.instance_id, now))
        yield from gauges.values()
        yield GaugeMetricFamily(P + "pool_blocks", "Blocks credited to the shared pool.", value=c.index.num_blocks(POOL))
        yield GaugeMetricFamily(P + "in_flight", "Routed requests not finished.", value=c.snapshot(now)["in_flight"])
        yield GaugeMetricFamily(P + "cluster_pins", "Live cluster pins, replayed to instances that join.",
                                value=len(self.pins.pins(now)))
        outcome = CounterMetricFamily(P + "requests", "Requests by outcome.", labels=["outcome"])
        outcome.add_metric(["completed"], s.completed)
        outcome.add_metric(["rejected"], sum(s.rejected.values()))
        outcome.add_metric(["decode_refused"], s.decode_refused)
        outcome.add_metric(["failed"], sum(s.failed.values()))
        outcome.add_metric(["aborted"], s.aborted)
        yield outcome
        rejected = CounterMetricFamily(P + "rejected", "Requests rejected at arrival by reason.", labels=["reason"])
        for reason, n in sorted(s.rejected.items()):
            rejected.add_metric([reason], n)
        yield rejected
        yield CounterMetricFamily(P + "prompt_tokens", "Prompt tokens prefilled.", value=s.prompt_tokens)
        yield CounterMetricFamily(P + "cached_prompt_tokens", "Prompt tokens the prefill instance reused.",
                                  value=s.cached_prompt_tokens)
        yield CounterMetricFamily(P + "generation_tokens", "Tokens generated.", value=s.generated_tokens)
        yield CounterMetricFamily(P + "wasted_prefill_tokens", "Prefill work lost to refusals after prefill.",
                                  value=c.stats.wasted_prefill_tokens)
        yield CounterMetricFamily(P + "slo_met", "Finished requests within both SLOs.", value=c.stats.slo_met)
        yield CounterMetricFamily(P + "ttft_seconds_sum", "Sum of TTFT seen by the gateway.", value=s.ttft_sum_s)
        yield CounterMetricFamily(P + "ttft_seconds_count", "Requests with a first token.", value=s.ttft_count)


def build_registry(poller: MemberPoller, conductor: Conductor, stats: RelayStats, pins: PinBook) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(GatewayCollector(poller, conductor, stats, pins))
    return registry
