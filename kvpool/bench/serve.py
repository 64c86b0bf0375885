"""`kvpool bench serve`: an online-serving benchmark client for any OpenAI-compatible server.

Sends streaming /v1/completions requests with token-id prompts (ignore_eos, so output lengths
are exact) at Poisson arrivals or a fixed concurrency, and reports throughput, TTFT, TPOT,
ITL, E2E latency, goodput under SLOs and, against a kvpool server, the prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from kvpool.bench.serve_metrics import (
    breakdown_delta,
    kv_breakdown,
    metric_sums,  # noqa: F401 - kvpool/bench/cluster.py reads it from here
    phase_table,
    prefix_counters,
    ttft_phases,
)
from kvpool.errors import ConfigError

logger = logging.getLogger(__name__)

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces


@dataclass(slots=True)
class BenchRequest:
    prompt: list[int]
    output_len: int


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


# -- the server's vocabulary -----------------------------------------------------------------
def probe_text(seed: int = 0, words: int = 3000) -> str:
    """Deterministic pseudo-text whose tokenization touches thousands of distinct tokens."""
    rng = random.Random(seed)
    letters, marks = "abcdefghijklmnopqrstuvwxyzeeeeaaoo", ",.;:!?()-'\"/0123456789"
    out = []
    for _ in range(words):
        word = "".join(rng.choice(letters) for _ in range(rng.randint(1, 9)))
        out.append(word.capitalize() if rng.random() < 0.2 else word)
        if rng.random() < 0.15:
            out.append(rng.choice(marks))
    return " ".join(out)


def server_token_ids(base_url: str, model: str, headers: dict[str, str]) -> list[int]:
    """Token ids of the server's own tokenizer, from its /tokenize route (kvpool's and vLLM's)."""
    try:
        r = httpx.post(base_url.rstrip("/") + "/tokenize", headers=headers, timeout=60,
                       json={"model": model, "prompt": probe_text(), "add_special_tokens": False})
        r.raise_for_status()
        ids = sorted(set(r.json()["tokens"]))
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot read the server's tokenizer from {base_url}/tokenize ({e}); "
                          "give --vocab-size to draw token ids below it instead") from None
    if not ids:
        raise ConfigError(f"{base_url}/tokenize returned no tokens; give --vocab-size")
    return ids


# -- datasets --------------------------------------------------------------------------------
def _tokens(rng: random.Random, n: int, pool) -> list[int]:
    return [rng.choice(pool) for _ in range(n)]


def random_dataset(args: argparse.Namespace, pool) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    return [BenchRequest(_tokens(rng, args.random_input_len, pool), args.random_output_len)
            for _ in range(args.num_prompts)]


def prefix_repetition_dataset(args: argparse.Namespace, pool) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    prefixes = [_tokens(rng, args.prefix_len, pool) for _ in range(args.num_prefixes)]
    return [BenchRequest(prefixes[i % len(prefixes)] + _tokens(rng, args.suffix_len, pool),
                         args.random_output_len) for i in range(args.num_prompts)]


def mooncake_dataset(args: argparse.Namespace, pool) -> list[BenchRequest]:
    """Token ids per hash id are a pure function of the id, so shared hash ids are shared prefixes."""
    if not args.mooncake_trace:
        raise ConfigError("--dataset mooncake needs --mooncake-trace FILE.jsonl")
    scale = args.mooncake_scale
    if not 0 < scale <= 1:
        raise ConfigError(f"--mooncake-scale must be in (0, 1], got {scale}")
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * scale))
    out = []
    with open(args.mooncake_trace) as f:
        for line in f:
            if len(out) == args.num_prompts:
                break
            rec = json.loads(line)
            prompt: list[int] = []
            for h in rec["hash_ids"]:
                prompt += _tokens(random.Random(h * 1_000_003 + args.seed), block, pool)
            length = max(1, min(len(prompt), round(rec["input_length"] * scale)))
            out.append(BenchRequest(prompt[:length], max(1, round(rec["output_length"] * scale))))
    return out


DATASETS = {"random": random_dataset, "prefix-repetition": prefix_repetition_dataset, "mooncake": mooncake_dataset}


# -- the client ------------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(False, len(req.prompt))
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                if data.get("usage"):
                    result.output_len = data["usage"]["completion_tokens"]
                if data.get("choices") and data["choices"][0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_len = result.output_len or chunks
    result.ok = chunks > 0
    return result


async def run(args: argparse.Namespace, requests: list[BenchRequest], model: str) -> tuple[list[RequestResult], float]:
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed)
    bar = tqdm(total=len(requests), desc="bench serve", unit="req", disable=args.no_progress)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async def one(req: BenchRequest) -> RequestResult:
        if limit is None:
            res = await send(client, url, model, req)
        else:
            async with limit:
                res = await send(client, url, model, req)
        bar.update(1)
        return res

    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def warm_up(args: argparse.Namespace, model: str, pool, headers: dict[str, str]) -> None:
    """Requests sent before the timed run and before its counters are read: a client's first
    request pays its own start-up (lazy imports, the first connection; 80-250 ms measured here),
    which is not the server's latency. Their prompts are drawn apart from the dataset's, so they
    warm no prefix the run will ask for (as `vllm bench serve`'s initial test prompt does)."""
    if not args.warmup_requests:
        return
    url = args.base_url.rstrip("/") + args.endpoint
    rng = random.Random(f"warm-up {args.seed}")
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None)) as client:
        for _ in range(args.warmup_requests):
            res = await send(client, url, model, BenchRequest(_tokens(rng, 16, pool), 2))
            if not res.ok:
                raise ConfigError(f"the warm-up request failed: {res.error or 'no tokens came back'}")


# -- reporting -------------------------------------------------------------------------------
def parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, ms = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not ms:
            raise ConfigError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        slos[key] = float(ms) / 1000
    return slos


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": float("nan"), "median_ms": float("nan"), "p99_ms": float("nan")}
    a = np.asarray(values) * 1000
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float],
              prefix: tuple[float, float] | None) -> dict:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft <= slos.get("ttft", float("inf"))
            and (r.tpot or 0.0) <= slos.get("tpot", float("inf")) and r.e2e <= slos.get("e2el", float("inf"))]
    out_tokens = sum(r.output_len for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "ttft": _stats([r.ttft for r in ok]), "tpot": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": _stats([x for r in ok for x in r.itl]), "e2el": _stats([r.e2e for r in ok]),
        "goodput": len(good) / duration if slos else None, "slos_s": slos,
        "prefix_cache_hit_rate": (prefix[1] / prefix[0] if prefix and prefix[0] else None),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    return summary


def print_summary(s: dict) -> None:
    print("=" * 18 + " Serving Benchmark Result " + "=" * 18)
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}")]
    if s["goodput"] is not None:
        rows.append(("Request goodput (req/s)", f"{s['goodput']:.2f}"))
    if s["prefix_cache_hit_rate"] is not None:
        rows.append(("Prefix cache hit rate", f"{s['prefix_cache_hit_rate']:.1%}"))
    for key, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        for stat in ("mean_ms", "median_ms", "p99_ms"):
            rows.append((f"{stat.split('_')[0].capitalize()} {title} (ms)", f"{s[key][stat]:.2f}"))
    split = s.get("prompt_kv_breakdown")
    if split is not None:
        total = sum(split["sources"].values()) + sum(split["misses"].values()) or 1
        rows += [(f"Prompt tokens from {k}", f"{n} ({n / total:.1%})") for k, n in split["sources"].items()]
        rows += [(f"Prompt tokens missed: {k}", f"{n} ({n / total:.1%})") for k, n in split["misses"].items()]
    for name, value in rows:
        print(f"{name:<40}{value:>20}")
    for err in s["errors"]:
        print(f"error: {err}")
    print("=" * 62)
    print_ttft_breakdown(s.get("ttft_breakdown"), s["ttft"]["mean_ms"])


def print_ttft_breakdown(table: dict[str, dict[str, float]] | None, ttft_mean_ms: float) -> None:
    """Where the run's TTFT went (a kvpool server's `ttft_breakdown_seconds`); the last row is the
    client's mean TTFT less the phases' means: HTTP before the server's arrival and what no phase holds."""
    if not table:
        return
    print(f"{'TTFT breakdown (ms)':<24}{'mean':>9}{'p50':>9}{'p99':>9}{'share':>9}")
    for phase, row in table.items():
        print(f"{phase:<24}{row['mean_ms']:>9.2f}{row['p50_ms']:>9.2f}{row['p99_ms']:>9.2f}"
              f"{row['mean_ms'] / ttft_mean_ms:>9.1%}")
    rest = ttft_mean_ms - sum(row["mean_ms"] for row in table.values())
    print(f"{'other (client TTFT)':<24}{rest:>9.2f}{'':>18}{rest / ttft_mean_ms:>9.1%}")
    print("=" * 62)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--base-url", default="http://127.0.0.1:8000")
    a("--endpoint", default="/v1/completions")
    a("--model", default=None, help="model id (default: the first of the server's /v1/models)")
    a("--api-key", default=None)
    a("--dataset", choices=sorted(DATASETS), default="random")
    a("--num-prompts", type=int, default=100)
    a("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    a("--max-concurrency", type=int, default=None)
    a("--random-input-len", type=int, default=128)
    a("--random-output-len", type=int, default=32, help="output tokens (random and prefix-repetition)")
    a("--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix tokens")
    a("--suffix-len", type=int, default=64, help="prefix-repetition: unique suffix tokens")
    a("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct shared prefixes")
    a("--mooncake-trace", default=None, help="a Mooncake trace .jsonl")
    a("--mooncake-scale", type=float, default=0.05, help="scale token lengths by this to fit the model")
    a("--vocab-size", type=int, default=None,
      help="draw synthetic token ids from 100..N-1 (default: ids of the server's own tokenizer, via /tokenize)")
    a("--goodput", nargs="*", default=[], help="SLOs such as ttft:500 tpot:50 (milliseconds)")
    a("--seed", type=int, default=0)
    a("--warmup-requests", type=int, default=1,
      help="untimed requests before the run (a client's first request pays its own start-up)")
    a("--save-result", default=None, help="write the summary as JSON here")
    a("--no-progress", action="store_true", help="hide the progress bar")


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    slos = parse_goodput(args.goodput)
    if args.vocab_size is not None and args.vocab_size <= 100:
        raise ConfigError(f"--vocab-size must be > 100, got {args.vocab_size}")
    if args.warmup_requests < 0:
        raise ConfigError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers,
                                        timeout=30).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ConfigError(f"cannot read the model id from {args.base_url}/v1/models ({e}); give --model") from None
    pool = range(100, args.vocab_size) if args.vocab_size else server_token_ids(args.base_url, model, headers)
    requests = DATASETS[args.dataset](args, pool)
    if not requests:
        raise ConfigError("the dataset produced no requests")
    asyncio.run(warm_up(args, model, pool, headers))
    before, split = prefix_counters(args.base_url, headers), kv_breakdown(args.base_url, headers)
    phases = ttft_phases(args.base_url, headers)
    results, duration = asyncio.run(run(args, requests, model))
    after = prefix_counters(args.base_url, headers)
    prefix = (after[0] - before[0], after[1] - before[1]) if before and after else None
    summary = summarize(results, duration, slos, prefix)
    summary["prompt_kv_breakdown"] = breakdown_delta(split, kv_breakdown(args.base_url, headers))
    summary["ttft_breakdown"] = phase_table(phases, ttft_phases(args.base_url, headers))
    summary.update({"model": model, "dataset": args.dataset, "num_prompts": len(requests),
                    "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
                    "per_request": [asdict(r) | {"itl": None} for r in results]})
    print_summary(summary)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(summary, indent=2))
    return 0 if summary["completed"] else 1
