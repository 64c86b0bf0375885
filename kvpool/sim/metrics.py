"""Latency metrics per request and in aggregate, with deterministic JSON and text tables.

Drivers record instants (virtual or wall clock) into a `RequestMetrics`; `summarize` turns
a run into the numbers the papers report: TTFT, TPOT/TBT, end-to-end and normalized latency
percentiles, throughput, SLO attainment and goodput.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpool.core.block_pool import BlockPool
from kvpool.core.retention import pinned_blocks
from kvpool.errors import ConfigError
from kvpool.sched.metrics import RequestMetrics

__all__ = ["RequestMetrics"]  # one per request in every driver; defined in the core

PERCENTILES = (50, 90, 99)


@dataclass(slots=True, frozen=True)
class SLO:
    """Latency objectives; a request meets its SLO when each set bound holds."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, m: RequestMetrics) -> bool:
        if not m.done:
            return False
        return all(
            bound is None or value <= bound
            for bound, value in ((self.ttft_s, m.ttft), (self.tpot_s, m.tpot), (self.e2e_s, m.e2e))
        )


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (NaN when empty, so a missing series is visible, not zero)."""
    if len(values) == 0:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    out = {"mean": float(arr.mean())}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


def summarize(
    metrics: Iterable[RequestMetrics], duration_s: float | None = None, slo: SLO | None = None
) -> dict:
    """Aggregate a run. Throughput is over `duration_s` (default: first arrival to last finish).

    Goodput counts only requests meeting `slo`; rejected and unfinished requests count
    against attainment.
    """
    ms = list(metrics)
    done = [m for m in ms if m.done]
    if duration_s is None:
        ends = [m.finish_s for m in done if m.finish_s is not None]
        duration_s = (max(ends) - min(m.arrival_s for m in ms)) if ends else 0.0
    if duration_s < 0:
        raise ConfigError(f"duration_s={duration_s} must be >= 0")
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    out_tokens = sum(m.output_len for m in done)
    tbt = np.concatenate([m.tbt for m in done] or [np.empty(0)])
    summary = {
        "requests": len(ms),
        "completed": len(done),
        "rejected": sum(m.rejected for m in ms),
        "duration_s": duration_s,
        "throughput_rps": rate(len(done)),
        "output_tokens_per_s": rate(out_tokens),
        "total_tokens_per_s": rate(out_tokens + sum(m.prompt_len for m in done)),
        "prefix_hit_rate": sum(m.cached_tokens for m in done) / max(sum(m.prompt_len for m in done), 1),
        "ttft_s": percentiles([m.ttft for m in done if m.token_times]),
        "tpot_s": percentiles([m.tpot for m in done if m.output_len > 1]),
        "tbt_s": percentiles(tbt),
        "e2e_s": percentiles([m.e2e for m in done]),
        "normalized_latency_s": percentiles([m.normalized_latency for m in done]),
    }
    if slo is not None:
        good = sum(slo.met(m) for m in ms)
        summary["slo_attainment"] = good / len(ms) if ms else math.nan
        summary["goodput_rps"] = rate(good)
    return summary


def retention_summary(pool: BlockPool, bytes_per_block: int) -> dict[str, float | int]:
    """Retention at a run's end as `kvpool serve` exports it (serve/retention_routes.py): the
    device KV held by live retentions (in MiB), pinned evictions and TTL expiries."""
    table = pool.retention
    return {"pinned_mib": pinned_blocks(pool) * bytes_per_block / 2**20,
            "pinned_evictions": 0 if table is None else table.num_pinned_evictions,
            "ttl_expiries": 0 if table is None else table.num_ttl_expiries}


def _rounded(obj, digits: int):
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else round(obj, digits)
    if isinstance(obj, dict):
        return {str(k): _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_rounded(v, digits) for v in obj]
    if isinstance(obj, np.generic):
        return _rounded(obj.item(), digits)
    return obj


def to_json(obj, digits: int = 6) -> str:
    """Sorted keys, floats rounded to `digits`, NaN/inf as null: same input, same bytes."""
    return json.dumps(_rounded(obj, digits), sort_keys=True, indent=2) + "\n"


def write_json(path: str | Path, obj, digits: int = 6) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(obj, digits))
    return path


def format_table(rows: Sequence[dict], columns: Sequence[str] | None = None, digits: int = 3) -> str:
    """Plain-text table of `rows` (dicts) with aligned columns; floats to `digits` places."""
    if not rows:
        return ""
    cols = list(columns) if columns is not None else list(rows[0])

    def cell(v) -> str:
        return f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    body = [[cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in body)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in body]
    return "\n".join(lines)


def flat_row(label: str, summary: dict, keys: Sequence[str] = ("ttft_s", "tpot_s", "e2e_s")) -> dict:
    """A table row from a summary: scalars plus mean/p99 of the given latency series."""
    row: dict = {"run": label}
    row.update({k: v for k, v in summary.items() if not isinstance(v, dict)})
    for k in keys:
        row[f"{k}.mean"] = summary[k]["mean"]
        row[f"{k}.p99"] = summary[k]["p99"]
    return row
