"""`kvpool bench kvstore --layerwise-prompt N [--layerwise-tier disk|redis]`: TTFT of one long prompt
whose first half comes from the disk tier (or a local redis-server), by three paths: store hits read
and written into the device cache whole between steps (`whole-block`, --no-kv-layerwise-load), read
and checked whole before the step but written layer by layer under the forward (`layer-wise write`),
and only their headers read before the step, each layer read, checked and written under the forward
(`layer-wise read`, the default; Redis reads them with GETRANGE). The tier's codec
is the engine flag's (--kv-disk-codec / --kv-remote-codec).

The lecture's §9.3 case (8.7K tokens, half in the pool) scaled to this machine: the first half is
served once and saved to disk (write-through), the device cache is emptied, and the whole prompt
is sent; the paths alternate `repeats` times and the median TTFT of each is reported. The
disk tier's files were just written, so reads come from the page cache, and Redis is on loopback:
the figure is the engine's overhead and overlap, not an SSD's or a network's.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.loader import load_model
from kvpool.sched.sampling_params import SamplingParams

PATHS = {"whole-block": (False, False), "layer-wise write": (True, False), "layer-wise read": (True, True)}


@dataclass(slots=True)
class LayerwiseResult:
    path: str  # one of PATHS
    tier: str
    prompt_tokens: int
    store_hit_tokens: int
    ttft_median_s: float
    ttft_s: list[float]
    stall_s: list[float]  # engine-thread time waiting for the loaded KV's device write, per run
    read_wait_s: list[float]  # engine-thread time waiting for the store reads and checks, per run


def _ttft(engine: Engine, prompt: list[int]) -> tuple[float, int, float, float]:
    engine.kv_store.store.flush()  # the previous run's saves would queue ahead of this run's loads
    engine.scheduler.kv.reset_prefix_cache()
    before = engine.scheduler.num_external_hit_tokens
    stall, read = engine.kv_store.load_stall_s, engine.kv_store.read_wait_s
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                if out.error:
                    raise SystemExit(f"kvpool bench kvstore: the prompt failed: {out.error}")
                m = out.metrics
                ttft = m.first_token_time - m.arrival_time
    store = engine.kv_store
    return ttft, engine.scheduler.num_external_hit_tokens - before, store.load_stall_s - stall, store.read_wait_s - read


def run_layerwise_bench(base: EngineConfig, prompt_len: int, repeats: int, json_path: str | None,
                        tier: str = "disk") -> int:
    if tier not in ("disk", "redis"):
        raise SystemExit(f"kvpool bench kvstore: unknown --layerwise-tier {tier!r}; choose disk or redis")
    if tier == "disk":
        with tempfile.TemporaryDirectory(prefix="kvpool-layerwise-") as disk:
            return _run(base, prompt_len, repeats, json_path, tier,
                        {"kv_disk_path": disk, "kv_disk_size": "8GiB", "kv_remote": None})
    from kvpool.store.services import redis_service

    service = redis_service()
    service.start()
    try:
        return _run(base, prompt_len, repeats, json_path, tier,
                    {"kv_disk_path": None, "kv_remote": f"redis://127.0.0.1:{service.port}/0",
                     "kv_layerwise_remote_reads": True})  # its layer-wise read path (off by default)
    finally:
        service.stop()


def _run(base: EngineConfig, prompt_len: int, repeats: int, json_path: str | None, tier: str, where: dict) -> int:
    loaded = load_model(base.model, dtype=getattr(torch, base.dtype))  # the engine's resolved dtype
    rng = np.random.default_rng(0)
    vocab = loaded.config.vocab_size
    half = rng.integers(0, vocab, size=prompt_len // 2).tolist()
    blocks = max(base.num_blocks or 0, prompt_len // base.block_size + 16)
    results = {path: LayerwiseResult(path, tier, prompt_len, 0, 0.0, [], [], []) for path in PATHS}
    cfg = replace(base, num_blocks=blocks, kv_host_memory="0", **where,
                  max_num_batched_tokens=max(base.max_num_batched_tokens, prompt_len))
    engine = Engine(cfg, loaded=loaded)  # one engine, one store: the paths differ in the connector's switches
    try:
        _ttft(engine, half)  # the first half's blocks are now in the tier
        engine.kv_store.store.flush()
        for _ in range(repeats):
            for path in PATHS:
                engine.kv_store.layerwise, engine.kv_store.layerwise_reads = PATHS[path]
                suffix = rng.integers(0, vocab, size=prompt_len - len(half)).tolist()  # never cached
                ttft, hit, stall, read = _ttft(engine, half + suffix)
                results[path].ttft_s.append(ttft)
                results[path].stall_s.append(stall)
                results[path].read_wait_s.append(read)
                results[path].store_hit_tokens = hit
    finally:
        engine.close()
    for r in results.values():
        r.ttft_median_s = statistics.median(r.ttft_s)
    off = results["whole-block"]
    source = "the disk tier (page cache)" if tier == "disk" else "redis on loopback"
    print(f"one {prompt_len}-token prompt, its first {off.store_hit_tokens} tokens from {source}, "
          f"{repeats} runs each, dtype {base.dtype}")
    print(f"{'path':<16} {'TTFT median':>11} {'read wait':>10} {'write stall':>12}  runs (TTFT s / stall ms)")
    for r in results.values():
        runs = " ".join(f"{t:.2f}/{s * 1e3:.1f}" for t, s in zip(r.ttft_s, r.stall_s, strict=True))
        print(f"{r.path:<16} {r.ttft_median_s:>10.3f}s {statistics.median(r.read_wait_s) * 1e3:>8.1f}ms "
              f"{statistics.median(r.stall_s) * 1e3:>10.1f}ms  {runs}")
    ratios = ", ".join(f"{r.path} {r.ttft_median_s / off.ttft_median_s:.3f}" for r in list(results.values())[1:])
    print(f"TTFT / whole-block: {ratios}. read wait: the engine thread waiting for the tier reads and checks "
          "before the step (layer-wise read: the headers only); write stall: waiting for the store KV's device "
          "write (whole-block: between steps; layer-wise: in the per-layer hooks, reads included, and the final join)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in results.values()], f, indent=2, sort_keys=True)
    return 0
