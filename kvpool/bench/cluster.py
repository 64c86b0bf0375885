"""`kvpool bench cluster`: the real local cluster under two workloads, one fresh cluster per run.

- `policies`: many requests over a few long shared documents; prefix hit rate (prompt tokens
  the prefill instance reused, from its device cache or the pool; and from its device cache alone)
  and mean TTFT per routing policy.
- `rejection`: a decode pool driven past capacity (tiny KV budget, few sequences, short queue);
  requests rejected at arrival, refused after prefill, wasted prefill tokens, completed and
  SLO attainment per rejection mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from kvpool.cluster.local import ClusterSpec, LocalCluster

BASE_ARGS = ["--max-model-len", "1024", "--threads", "1"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", choices=("policies", "rejection", "all"))
    parser.add_argument("--pool", choices=("redis", "mooncake", "none"), default="redis",
                        help="none: colocated instances (--role both) with no shared pool")
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks per prefill instance")
    parser.add_argument("--policies", default="random,least-load,cache-aware,kv-centric")
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--doc-sentences", type=int, default=20, help="~20 tokens each")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--rejections", default="none,early,predictive")
    parser.add_argument("--ttft-slo", type=float, default=4.0)
    parser.add_argument("--tbt-slo", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")


def _document(d: int, sentences: int) -> str:
    return " ".join(f"Record {d}.{i}: the depot at site {d} shipped {i * 11 + d} units of part {i % 7} "
                    f"on day {i + 1}." for i in range(sentences))


async def _send(client: httpx.AsyncClient, url: str, body: dict) -> int:
    r = await client.post(url + "/v1/completions", json=body, timeout=600)
    return r.status_code


async def _drive(url: str, bodies: list[dict], rate: float, seed: int) -> dict[int, int]:
    """Send `bodies` with Poisson arrivals at `rate`; count responses by HTTP status."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        for body in bodies:
            tasks.append(asyncio.ensure_future(_send(client, url, body)))
            await asyncio.sleep(rng.expovariate(rate))
        statuses = await asyncio.gather(*tasks)
    counts: dict[int, int] = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    return counts


def _run(spec: ClusterSpec, bodies: list[dict], rate: float, seed: int) -> dict:
    cluster = LocalCluster(spec)
    cluster.up(progress=lambda _: None)
    try:
        statuses = asyncio.run(_drive(cluster.conductor_url, bodies, rate, seed))
        time.sleep(0.5)
        state = httpx.get(cluster.conductor_url + "/cluster").json()
        local = sum(_metric(url, "kvpool:prefix_cache_hits_total")
                    for url in cluster.urls("prefill") + cluster.urls("both"))
    finally:
        cluster.down()
    return {"statuses": statuses, "cluster": state, "local_hit_tokens": local}


def _metric(url: str, name: str) -> float:
    """Sum of one Prometheus series (all labels) on an instance's /metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def policies(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    docs = [_document(d, args.doc_sentences) for d in range(args.documents)]
    bodies = [{"prompt": f"{rng.choice(docs)}\nQuestion {i}: which site shipped most?\nAnswer:",
               "max_tokens": 4, "temperature": 0} for i in range(args.requests)]
    rows = []
    for policy in args.policies.split(","):
        instance_args = [*BASE_ARGS, "--num-blocks", str(args.num_blocks)]
        if args.pool == "none":
            spec = ClusterSpec(colocated=2, pool="none", instance_args=instance_args, conductor_args=["--policy", policy])
        else:
            spec = ClusterSpec(prefill=2, decode=1, pool=args.pool, instance_args=instance_args,
                               conductor_args=["--policy", policy])
        out = _run(spec, bodies, args.rate, args.seed)
        g = out["cluster"]["gateway"]
        rows.append({"policy": policy, "completed": g["completed"],
                     "hit_rate": g["cached_prompt_tokens"] / max(1, g["prompt_tokens"]),
                     "local_hit_rate": out["local_hit_tokens"] / max(1, g["prompt_tokens"]),
                     "mean_ttft_s": g["mean_ttft_s"], "pulls": out["cluster"]["stats"]["pulls"],
                     "statuses": out["statuses"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def rejection(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    bodies = [{"prompt": _document(100 + i, 8) + f"\nItem {rng.randrange(10**6)}:", "max_tokens": 32,
               "temperature": 0, "ignore_eos": True} for i in range(args.requests)]
    rows = []
    for mode in args.rejections.split(","):
        spec = ClusterSpec(
            prefill=1, decode=1, pool=args.pool, instance_args=[*BASE_ARGS, "--num-blocks", "256"],
            decode_args=["--num-blocks", "48", "--max-num-seqs", "2", "--max-queue", "1"],
            conductor_args=["--policy", "kv-centric", "--rejection", mode, "--ttft-slo", str(args.ttft_slo),
                            "--tbt-slo", str(args.tbt_slo)])
        out = _run(spec, bodies, args.rate, args.seed)
        c, g = out["cluster"]["stats"], out["cluster"]["gateway"]
        rows.append({"rejection": mode, "requests": len(bodies),
                     "rejected_at_arrival": sum(c["rejected_at_arrival"].values()),
                     "refused_after_prefill": g["decode_refused"],
                     "wasted_prefill_tokens": c["wasted_prefill_tokens"], "completed": g["completed"],
                     "slo_met": c["slo_met"], "slo_attainment": c["slo_met"] / len(bodies),
                     "statuses": out["statuses"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(args: argparse.Namespace) -> int:
    results: dict[str, list[dict]] = {}
    if args.experiment in ("policies", "all"):
        results["policies"] = policies(args)
    if args.experiment in ("rejection", "all"):
        results["rejection"] = rejection(args)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
    return 0
