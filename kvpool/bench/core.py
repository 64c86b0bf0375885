"""`kvpool bench core`: the KV manager and scheduler on a synthetic serving workload.

Reports operations per second and the cost of one decode step's bookkeeping for 256
running sequences, next to the time a 135M-parameter model needs for that step on this
machine (its FLOPs over the fp32 matmul rate measured in the same run).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

from tqdm import tqdm

from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.output import Sample
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig

SMOLLM2_FLOPS_PER_TOKEN = 2 * 134_515_008  # 2 x parameters, LM head included


@dataclass(slots=True)
class CoreBenchResult:
    sequences: int
    operations: int
    ops_per_second: float
    manager_us_per_decode_step_256: float
    scheduler_us_per_decode_step_256: float
    model_ms_per_decode_step_256: float
    matmul_gflops: float
    bookkeeping_fraction_of_step: float
    prefix_hit_rate: float
    cow_copies: int


def _replay(num_seqs: int, seed: int) -> tuple[int, float, KVCacheManager]:
    """Allocate, decode, fork and free `num_seqs` sequences with shared system prompts."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=16384, block_size=16)
    prefixes = [[rng.randrange(32000) for _ in range(rng.randint(64, 512))] for _ in range(16)]
    live: list[tuple[int, list[int]]] = []
    ops, next_id = 0, 0
    start = time.perf_counter()
    for _ in tqdm(range(num_seqs), desc="replay", unit="seq", leave=False):
        toks = rng.choice(prefixes) + [rng.randrange(32000) for _ in range(rng.randint(8, 256))]
        sid, next_id = next_id, next_id + 1
        while kv.num_free_blocks < 64 and live:
            kv.free(live.pop(0)[0])
            ops += 1
        kv.allocate(sid, toks)
        kv.commit(sid, toks, len(toks))
        live.append((sid, toks))
        ops += 2
        if rng.random() < 0.1:
            child, next_id = next_id, next_id + 1
            kv.fork(sid, child)
            live.append((child, list(toks)))
            ops += 1
        for _ in range(rng.randint(4, 32)):
            s, t = live[rng.randrange(len(live))]
            if kv.num_free_blocks < 4:
                break
            kv.append_slots(s)
            t.append(rng.randrange(32000))
            kv.commit(s, t, len(t))
            ops += 2
    for sid, _ in live:
        kv.free(sid)
        ops += 1
    return ops, time.perf_counter() - start, kv


def _manager_decode_step(reps: int) -> float:
    kv = KVCacheManager(num_blocks=16384, block_size=16)
    seqs = []
    for i in range(256):
        toks = [i] * 200
        kv.allocate(i, toks)
        kv.commit(i, toks, 200)
        seqs.append(toks)
    start = time.perf_counter()
    for _ in range(reps):
        for i, t in enumerate(seqs):
            kv.append_slots(i)
            t.append(1)
            kv.commit(i, t, len(t))
    return (time.perf_counter() - start) / reps * 1e6


def _scheduler_decode_step(reps: int) -> float:
    sched = Scheduler(SchedulerConfig(num_blocks=16384, block_size=16, max_num_seqs=256))
    for i in range(256):
        g = SequenceGroup(f"r{i}", [sched.new_sequence([i % 100] * 200)],
                          SamplingParams(max_tokens=reps + 10, temperature=0.0, ignore_eos=True), float(i))
        sched.add_request(g)
    out = sched.schedule()
    sched.postprocess(out, [Sample([1]) for _ in out.sampling])
    start = time.perf_counter()
    for _ in range(reps):
        out = sched.schedule()
        sched.postprocess(out, [Sample([1]) for _ in out.sampling])
    return (time.perf_counter() - start) / reps * 1e6


def run(num_seqs: int = 5000, seed: int = 0, json_path: str | None = None) -> CoreBenchResult:
    ops, secs, kv = _replay(num_seqs, seed)
    mgr_us = _manager_decode_step(50)
    sched_us = _scheduler_decode_step(50)
    # torch only here: the rest of this benchmark is the pure core
    from kvpool.bench.limits import measure_matmul_gflops

    gflops = measure_matmul_gflops()
    model_ms = 256 * SMOLLM2_FLOPS_PER_TOKEN / (gflops * 1e9) * 1e3
    res = CoreBenchResult(
        sequences=num_seqs, operations=ops, ops_per_second=ops / secs,
        manager_us_per_decode_step_256=mgr_us, scheduler_us_per_decode_step_256=sched_us,
        model_ms_per_decode_step_256=model_ms, matmul_gflops=gflops,
        bookkeeping_fraction_of_step=sched_us / 1e3 / model_ms,
        prefix_hit_rate=kv.stats.hit_rate, cow_copies=kv.num_cow_copies,
    )
    print(f"replayed {num_seqs} sequences, {ops} manager operations in {secs:.2f} s: {ops / secs:,.0f} ops/s")
    print(f"prefix hit rate {res.prefix_hit_rate:.1%}, copy-on-write copies {res.cow_copies}")
    print(f"decode step, 256 running sequences: manager {mgr_us:,.0f} us, scheduler+manager {sched_us:,.0f} us")
    print(f"SmolLM2-135M decode step of 256 tokens at {gflops:.0f} GFLOP/s (measured now): {model_ms:,.1f} ms")
    print(f"bookkeeping = {res.bookkeeping_fraction_of_step:.2%} of a model step")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(asdict(res), f, indent=2, sort_keys=True)
    return res
