"""`kvpool bench cluster`: the real local cluster under two workloads, one fresh cluster per run.

- `policies`: questions over shared documents, the workload of simulator experiment 11
  (`DocumentsWorkload`: the documents exceed one instance's KV cache but fit in the
  cluster's); prefix hit rate (prompt tokens the prefill instance reused, from its device
  cache or the pool; and from its device cache alone) and client-side TTFT per routing policy.
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
import numpy as np

from kvpool.bench.serve import metric_sums
from kvpool.cluster.local import POOLS, ClusterSpec, LocalCluster
from kvpool.engine.loader import load_tokenizer
from kvpool.sim.experiments.conductor_policies import DocumentsWorkload
from kvpool.sim.workloads import arrival_times

BASE_ARGS = ["--max-model-len", "1024", "--threads", "1"]
DOCS = DocumentsWorkload()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", choices=("policies", "rejection", "all"))
    parser.add_argument("--pool", choices=POOLS, default=None,
                        help="policies: none (colocated instances, the default) or a pool (--instances prefill "
                             "instances + 1 decode); rejection: redis (default) or mooncake")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    p = parser.add_argument_group("policies (defaults: the documents workload of sim experiment 11)")
    p.add_argument("--policies", default="random,least-load,cache-aware,kv-centric")
    p.add_argument("--instances", type=int, default=DOCS.instances, help="instances that prefill")
    p.add_argument("--num-blocks", type=int, default=DOCS.blocks_per_instance, help="KV blocks per such instance")
    p.add_argument("--documents", type=int, default=DOCS.documents)
    p.add_argument("--doc-tokens", type=int, default=DOCS.doc_tokens)
    p.add_argument("--question-tokens", type=int, default=DOCS.question_tokens)
    p.add_argument("--max-tokens", type=int, default=DOCS.output_tokens, help="output tokens per request")
    p.add_argument("--requests", type=int, default=DOCS.requests)
    p.add_argument("--rate", type=float, default=DOCS.rate, help="requests per second (Poisson)")
    r = parser.add_argument_group("rejection")
    r.add_argument("--rejections", default="none,early,predictive")
    r.add_argument("--rejection-requests", type=int, default=40)
    r.add_argument("--rejection-rate", type=float, default=2.0)
    r.add_argument("--ttft-slo", type=float, default=4.0)
    r.add_argument("--tbt-slo", type=float, default=0.25)


def _document(d: int, sentences: int) -> str:
    return " ".join(f"Record {d}.{i}: the depot at site {d} shipped {i * 11 + d} units of part {i % 7} "
                    f"on day {i + 1}." for i in range(sentences))


def _exactly(ids: list[int], n: int) -> list[int]:
    """`n` tokens: `ids` cut, or repeated until long enough."""
    return (ids * (n // max(len(ids), 1) + 1))[:n]


def document_prompts(w: DocumentsWorkload, which: np.ndarray, model: str | None = None) -> list[list[int]]:
    """Token-id prompts laid out as the simulator's: document `which[i]` of exactly
    `doc_tokens` tokens, then a question of exactly `question_tokens`, each request's own."""
    tok = load_tokenizer(model)
    docs = [_exactly(tok.encode(_document(d, w.doc_tokens // 10)), w.doc_tokens) for d in range(w.documents)]
    questions = [_exactly(tok.encode(f" Question {i}: which site shipped the most units of part {i % 7}, and on "
                                     f"which day? Answer:"), w.question_tokens) for i in range(w.requests)]
    return [docs[int(which[i])] + questions[i] for i in range(w.requests)]


async def _send(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, float | None]:
    """(HTTP status, seconds to the first streamed token or None)."""
    start = time.monotonic()
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.monotonic() - start
        return r.status_code, first if r.status_code == 200 else None


async def _drive(url: str, bodies: list[dict], arrivals: list[float]) -> list[tuple[int, float | None]]:
    """Send each body at its arrival instant (seconds from the start)."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.monotonic()
        tasks = []
        for body, at in zip(bodies, arrivals, strict=True):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.ensure_future(_send(client, url, body)))
        return await asyncio.gather(*tasks)


def _run(spec: ClusterSpec, bodies: list[dict], arrivals: list[float]) -> dict:
    cluster = LocalCluster(spec)
    cluster.up(progress=lambda _: None)
    try:
        results = asyncio.run(_drive(cluster.conductor_url, bodies, arrivals))
        time.sleep(0.5)
        state = httpx.get(cluster.conductor_url + "/cluster").json()
        urls = cluster.urls("prefill") + cluster.urls("both")
        scraped = [metric_sums(url) for url in urls]
        local = sum(m.get("kvpool:prefix_cache_hits_total", 0.0) for m in scraped)
        cached = sum(m.get("kvpool:kv_blocks_cached", 0.0) for m in scraped)
    finally:
        cluster.down()
    statuses: dict[int, int] = {}
    for status, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    ttfts = [t for _, t in results if t is not None]
    indexed = sum(v["cached_blocks"] for v in state["instances"].values() if v["url"] in urls)
    return {"statuses": statuses, "ttfts": ttfts, "cluster": state, "local_hit_tokens": local,
            "index_vs_cached_blocks": [indexed, cached]}


def _policy_spec(args: argparse.Namespace, policy: str) -> ClusterSpec:
    instance_args = [*BASE_ARGS, "--num-blocks", str(args.num_blocks)]
    conductor_args = ["--policy", policy, "--seed", str(args.seed)]
    pool = args.pool or "none"
    if pool == "none":
        return ClusterSpec(colocated=args.instances, pool="none", instance_args=instance_args,
                           conductor_args=conductor_args)
    return ClusterSpec(prefill=args.instances, decode=1, pool=pool, instance_args=instance_args,
                       conductor_args=conductor_args)


def policies(args: argparse.Namespace) -> list[dict]:
    w = DocumentsWorkload(instances=args.instances, blocks_per_instance=args.num_blocks, documents=args.documents,
                          doc_tokens=args.doc_tokens, question_tokens=args.question_tokens,
                          output_tokens=args.max_tokens, requests=args.requests, rate=args.rate, seed=args.seed)
    arrivals, which = w.draws()
    bodies = [{"prompt": p, "max_tokens": w.output_tokens, "temperature": 0, "ignore_eos": True}
              for p in document_prompts(w, which)]
    rows = []
    for policy in args.policies.split(","):
        out = _run(_policy_spec(args, policy), bodies, arrivals.tolist())
        g = out["cluster"]["gateway"]
        ttfts = np.array(out["ttfts"]) if out["ttfts"] else np.array([np.nan])
        rows.append({"policy": policy, "completed": g["completed"],
                     "hit_rate": g["cached_prompt_tokens"] / max(1, g["prompt_tokens"]),
                     "local_hit_rate": out["local_hit_tokens"] / max(1, g["prompt_tokens"]),
                     "ttft_mean_s": float(ttfts.mean()), "ttft_p90_s": float(np.percentile(ttfts, 90)),
                     "pulls": out["cluster"]["stats"]["pulls"], "statuses": out["statuses"],
                     "index_vs_cached_blocks": out["index_vs_cached_blocks"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def rejection(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    n = args.rejection_requests
    bodies = [{"prompt": _document(100 + i, 8) + f"\nItem {rng.randrange(10**6)}:", "max_tokens": 32,
               "temperature": 0, "ignore_eos": True} for i in range(n)]
    arrivals = arrival_times(np.random.default_rng(args.seed), n, args.rejection_rate).tolist()
    rows = []
    for mode in args.rejections.split(","):
        spec = ClusterSpec(
            prefill=1, decode=1, pool=args.pool or "redis", instance_args=[*BASE_ARGS, "--num-blocks", "256"],
            decode_args=["--num-blocks", "48", "--max-num-seqs", "2", "--max-queue", "1"],
            conductor_args=["--policy", "kv-centric", "--rejection", mode, "--ttft-slo", str(args.ttft_slo),
                            "--tbt-slo", str(args.tbt_slo)])
        out = _run(spec, bodies, arrivals)
        c, g = out["cluster"]["stats"], out["cluster"]["gateway"]
        rows.append({"rejection": mode, "requests": n,
                     "rejected_at_arrival": sum(c["rejected_at_arrival"].values()),
                     "refused_after_prefill": g["decode_refused"],
                     "wasted_prefill_tokens": c["wasted_prefill_tokens"], "completed": g["completed"],
                     "slo_met": c["slo_met"], "slo_attainment": c["slo_met"] / n,
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
