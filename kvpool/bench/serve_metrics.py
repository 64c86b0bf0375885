"""What `kvpool bench serve` reads from a kvpool server's /metrics around its run: the prefix
cache's counters, the prompt tokens by KV source and miss reason, and the TTFT breakdown
(`kvpool:ttft_breakdown_seconds{phase}`: mean and quantiles of the run's requests, from the
histogram's differences, as Prometheus' `histogram_quantile` reads them). Other servers have
none of these: each reader returns None for them."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpool.serve.metrics import TTFT_PHASES

TTFT_BREAKDOWN = "kvpool:ttft_breakdown_seconds"


def metric_sums(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """A server's /metrics as sample name -> value summed over labels (prometheus_client's
    parser: the exposition format has escapes and label sets a line split would get wrong)."""
    text = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def prefix_counters(base_url: str, headers: dict[str, str] | None = None) -> tuple[float, float] | None:
    """(queries, hits) in tokens from a kvpool server's /metrics; None for other servers."""
    try:
        values = metric_sums(base_url, headers)
    except (httpx.HTTPError, ValueError):
        return None
    q, h = values.get("kvpool:prefix_cache_queries_total"), values.get("kvpool:prefix_cache_hits_total")
    return None if q is None or h is None else (q, h)


KV_BREAKDOWN = (("sources", "kvpool:prompt_tokens_by_kv_source_total", "source"),
                ("misses", "kvpool:prompt_tokens_missed_total", "reason"))


def kv_breakdown(base_url: str, headers: dict[str, str] | None = None) -> dict[str, dict[str, float]] | None:
    """A kvpool server's prompt tokens so far by KV source and by miss reason (its /metrics,
    kvpool/core/miss_reasons.py); None for other servers."""
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
        families = list(text_string_to_metric_families(text))
    except (httpx.HTTPError, ValueError):
        return None
    out: dict[str, dict[str, float]] = {key: {} for key, _, _ in KV_BREAKDOWN}
    for family in families:
        for sample in family.samples:
            for key, name, label in KV_BREAKDOWN:
                if sample.name == name:
                    out[key][sample.labels[label]] = out[key].get(sample.labels[label], 0.0) + sample.value
    return out if any(f.name == "kvpool:prompt_tokens_missed" for f in families) else None


def breakdown_delta(before: dict | None, after: dict | None) -> dict[str, dict[str, int]] | None:
    if before is None or after is None:
        return None
    return {key: {k: int(v - before[key].get(k, 0.0)) for k, v in sorted(after[key].items())
                  if v > before[key].get(k, 0.0)} for key in after}


def ttft_phases(base_url: str, headers: dict[str, str] | None = None) -> dict[str, dict] | None:
    """The TTFT breakdown histogram so far: phase -> {"buckets": {le: cumulative count}, "sum", "count"}
    (summed over models); None if the server has none."""
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
        families = list(text_string_to_metric_families(text))
    except (httpx.HTTPError, ValueError):
        return None
    out: dict[str, dict] = {}
    for family in families:
        if family.name != TTFT_BREAKDOWN:
            continue
        for sample in family.samples:
            h = out.setdefault(sample.labels["phase"], {"buckets": {}, "sum": 0.0, "count": 0.0})
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                h["buckets"][le] = h["buckets"].get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                h["sum"] += sample.value
            elif sample.name.endswith("_count"):
                h["count"] += sample.value
    return out or None


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' `histogram_quantile`: `buckets` as (upper bound, cumulative count), ascending,
    ending at +Inf; linear within the bucket holding the q-th observation."""
    total = buckets[-1][1]
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / (cum - below) if cum > below else 1.0)
        lower, below = le, cum
    return lower


def phase_table(before: dict[str, dict] | None, after: dict[str, dict] | None) -> dict[str, dict[str, float]] | None:
    """The run's requests per phase (the difference of two `ttft_phases`): count, mean, p50, p99 in ms."""
    if after is None:
        return None
    before = before or {}
    table = {}
    for phase in sorted(after, key=lambda p: TTFT_PHASES.index(p) if p in TTFT_PHASES else len(TTFT_PHASES)):
        a, b = after[phase], before.get(phase, {"buckets": {}, "sum": 0.0, "count": 0.0})
        count = a["count"] - b["count"]
        if count <= 0:
            continue
        buckets = [(le, cum - b["buckets"].get(le, 0.0)) for le, cum in sorted(a["buckets"].items())]
        table[phase] = {"count": count, "mean_ms": (a["sum"] - b["sum"]) / count * 1000,
                        "p50_ms": bucket_quantile(0.5, buckets) * 1000,
                        "p99_ms": bucket_quantile(0.99, buckets) * 1000}
    return table or None
