"""`kvpool bench kvstore`: multi-turn chat with a device KV pool too small for all sessions.

Each turn's prompt is the previous prompt + the answer + a new question; sessions are
interleaved so the device prefix cache evicts a session before its next turn. The same
workload runs with the store off (device-only prefix caching), host DRAM only, host + disk,
and a remote pool (a local redis-server), and the bench reports prefill tokens computed and
mean / p99 TTFT for each, with ratios against device-only.

`--codecs none,zstd,zstd-shuffle` measures the block codecs instead (kvstore_codec.py): bytes per
block and save / load (read + decode) time per tier on real KV blocks of the model.
`--layerwise-prompt N` measures layer-wise loading of store hits instead (kvstore_layerwise.py).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from tqdm import tqdm

from kvpool.engine.config import EngineConfig, add_engine_args, engine_config_from_args
from kvpool.engine.engine import Engine
from kvpool.engine.loader import load_model
from kvpool.sched.sampling_params import SamplingParams


@dataclass(slots=True)
class StoreRunResult:
    config: str
    prefill_tokens: int
    store_hit_tokens: int
    device_hit_tokens: int
    ttft_mean_s: float
    ttft_p99_s: float
    elapsed_s: float


def run_sessions(engine: Engine, sessions: int, turns: int, system_len: int, question_len: int,
                 answer_len: int, vocab: int, seed: int, label: str, concurrency: int) -> StoreRunResult:
    """Turn by turn, sessions in order, `concurrency` requests in flight at a time."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, size=system_len).tolist()
    history = [list(system) for _ in range(sessions)]
    params = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    device_hits0 = engine.scheduler.kv.stats.hits_tokens
    start = time.perf_counter()
    for _ in tqdm(range(turns), desc=label, unit="turn", leave=False):
        for first in range(0, sessions, concurrency):
            ids = {}
            for s in range(first, min(sessions, first + concurrency)):
                history[s] += rng.integers(0, vocab, size=question_len).tolist()
                ids[engine.add_request(list(history[s]), params)] = s
            while engine.has_unfinished():
                for out in engine.step():  # each step's new tokens
                    history[ids[out.request_id]] += out.outputs[0].token_ids if out.outputs else []
                    if out.finished:
                        m = out.metrics
                        ttfts.append(m.first_token_time - m.arrival_time)
    elapsed = time.perf_counter() - start
    if engine.kv_store is not None:
        engine.kv_store.store.flush()
    return StoreRunResult(
        label, engine.num_prompt_tokens, engine.scheduler.num_external_hit_tokens,
        engine.scheduler.kv.stats.hits_tokens - device_hits0, float(np.mean(ttfts)),
        float(np.percentile(ttfts, 99)), elapsed,
    )


def add_arguments(p) -> None:
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at a time")
    p.add_argument("--configs", default="off,host,host+disk,remote",
                   help="comma list of off | host | host+disk | disk | remote")
    p.add_argument("--json", default=None)
    p.add_argument("--codecs", default=None,
                   help="comma list of block codecs (none, zstd, zstd-shuffle, int8[+zstd], int4[+zstd]): bytes per block and "
                   "load time per tier on real KV blocks instead of running the session workload")
    p.add_argument("--codec-tiers", default="disk,remote", help="tiers for --codecs: disk | remote")
    p.add_argument("--codec-tokens", type=int, default=2048, help="prompt tokens whose KV blocks --codecs stores")
    p.add_argument("--layerwise-prompt", type=int, default=None,
                   help="TTFT of one prompt of this many tokens whose first half comes from the disk tier, store hits "
                   "written whole vs layer by layer (kvstore_layerwise.py), instead of the session workload")
    p.add_argument("--repeats", type=int, default=3, help="runs of each path for --layerwise-prompt")
    p.add_argument("--layerwise-tier", default="disk", help="where --layerwise-prompt's hit comes from: disk | redis")
    add_engine_args(p)
    p.set_defaults(num_blocks=64)


def main(args) -> int:
    base = engine_config_from_args(args)
    if args.codecs:
        from kvpool.bench.kvstore_codec import run_codec_bench

        return run_codec_bench(base, args.codecs.split(","), args.codec_tiers.split(","), args.codec_tokens,
                               args.json)
    if args.layerwise_prompt:
        from kvpool.bench.kvstore_layerwise import run_layerwise_bench

        return run_layerwise_bench(base, args.layerwise_prompt, args.repeats, args.json, args.layerwise_tier)
    loaded = load_model(base.model, dtype=getattr(torch, base.dtype))  # the engine's resolved dtype
    results = []
    with tempfile.TemporaryDirectory(prefix="kvpool-disk-") as disk_dir:
        redis = None
        for name in args.configs.split(","):
            cfg = _config(base, name, disk_dir)
            if name == "remote":
                from kvpool.store.services import redis_service

                redis = redis_service()
                redis.start()
                cfg = replace(cfg, kv_remote=f"redis://127.0.0.1:{redis.port}/0")
            engine = Engine(cfg, loaded=loaded)
            try:
                results.append(run_sessions(engine, args.sessions, args.turns, args.system_len, args.question_len,
                                            args.answer_len, loaded.config.vocab_size, 0, name,
                                            args.concurrency))
            finally:
                engine.close()
                if redis is not None:
                    redis.stop()
                    redis = None
    ref = next((r for r in results if r.config == "off"), results[0])
    print(f"{args.sessions} sessions x {args.turns} turns, {args.concurrency} in flight, "
          f"device pool {base.num_blocks} blocks x {base.block_size}")
    print(f"{'store':<10} {'prefill tok':>11} {'store hits':>10} {'device hits':>11} {'TTFT mean':>10} "
          f"{'TTFT p99':>9} {'prefill x':>9} {'TTFT x':>7}")
    for r in results:
        print(f"{r.config:<10} {r.prefill_tokens:>11} {r.store_hit_tokens:>10} {r.device_hit_tokens:>11} "
              f"{r.ttft_mean_s:>9.2f}s {r.ttft_p99_s:>8.2f}s {ref.prefill_tokens / max(1, r.prefill_tokens):>8.2f}x "
              f"{ref.ttft_mean_s / r.ttft_mean_s:>6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2, sort_keys=True)
    return 0


def _config(base: EngineConfig, name: str, disk_dir: str) -> EngineConfig:
    if name == "off":
        return base
    if name == "host":
        return replace(base, kv_host_memory="2GiB")
    if name == "disk":
        return replace(base, kv_disk_path=f"{disk_dir}/disk-only", kv_disk_size="4GiB")
    if name == "host+disk":
        return replace(base, kv_host_memory="64MiB", kv_disk_path=f"{disk_dir}/tiered", kv_disk_size="4GiB",
                       kv_write_policy="write-through")
    if name == "remote":
        return base
    raise SystemExit(f"kvpool bench kvstore: unknown config {name!r}")
