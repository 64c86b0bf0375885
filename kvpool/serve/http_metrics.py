"""The HTTP and process metrics vLLM's /metrics carries besides its own (prometheus-fastapi-
instrumentator's and prometheus_client's default collectors), on the app's own registry:

- `http_requests_total{handler, method, status}` (status grouped as `2xx`, `4xx`, ...),
- `http_request_duration_seconds{handler, method}` (buckets 0.1, 0.5, 1) and
  `http_request_duration_highr_seconds` (fine buckets, no labels),
- `process_*` (CPU, memory, file descriptors) and `python_*` (GC, platform).

`handler` is the route's path template (`/v1/chat/completions`), `none` for a path no route
matched, so a client inventing paths cannot grow the label set.
"""

from __future__ import annotations

import time

from prometheus_client import GC_COLLECTOR, CollectorRegistry, Counter, Histogram
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

_LOWR_BUCKETS = (0.1, 0.5, 1.0)
_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0,
                  7.5, 10.0, 30.0, 60.0)


def add_process_collectors(registry: CollectorRegistry) -> None:
    """process_* and python_* as prometheus_client's default registry has them."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    if GC_COLLECTOR is not None:
        GCCollector(registry=registry)


class HTTPMetrics:
    """Request counts and latencies per route."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                ["handler", "method", "status"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler.",
                                  ["handler", "method"], buckets=_LOWR_BUCKETS, registry=registry)
        self.duration_highr = Histogram("http_request_duration_highr_seconds", "Latency with many buckets but no "
                                        "API specific labels.", buckets=_HIGHR_BUCKETS, registry=registry)

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(handler, method, f"{status // 100}xx").inc()
        self.duration.labels(handler, method).observe(seconds)
        self.duration_highr.observe(seconds)


class HTTPMetricsMiddleware:
    """ASGI middleware: times each HTTP request until its last body byte is sent."""

    def __init__(self, app, metrics: HTTPMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        scope.setdefault("state", {})["received_s"] = time.monotonic()  # the TTFT breakdown's start
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            handler = getattr(route, "path", None) or "none"
            self.metrics.observe(handler, scope.get("method", "GET"), status, time.perf_counter() - start)


def received_s(request) -> float | None:
    """When `HTTPMetricsMiddleware` saw the request begin (time.monotonic()), if it did."""
    return request.scope.get("state", {}).get("received_s")
