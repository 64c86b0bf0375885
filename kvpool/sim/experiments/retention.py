"""Experiment: a retained system prompt under cache pressure (issue 32 item 1).

One instance with a small KV cache. Every `EVERY`-th request starts with the same system prompt
(`SYSTEM` tokens) and asks for it to be retained; the others are long one-off prompts whose
blocks, under plain LRU, flush the system prompt out between two of its uses. The retention
goes through the same path as a served request's (`SamplingParams.retention`, admission's
hashes, the pool's `RetentionTable`, TTLs against the virtual clock), so the rows compare the
engine's own eviction rule with and without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvpool.core.retention import RetentionRequest
from kvpool.costs.presets import get_model
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import ExperimentResult, check_size, roofline
from kvpool.sim.instance import InstanceRun, run_instance
from kvpool.sim.metrics import retention_summary
from kvpool.sim.workloads import OUTPUT_CHUNK_BASE, SYNTHETIC_CHUNK_BASE, SimRequest, arrival_times

MODEL, HARDWARE = "llama2-13b", "a100-40gb"
BLOCK = 16
NUM_BLOCKS = 256  # 4,096 tokens: three one-off prompts fill it
SYSTEM = 1024  # tokens of the shared system prompt (64 blocks)
QUESTION, ONE_OFF, OUTPUT = 64, 1536, 16
EVERY = 4  # one request in EVERY carries the system prompt
RATE = 1.0  # requests/s: about one at a time, so only eviction decides the hits

# (label, the system-prompt requests' retention: None for none)
VARIANTS = (
    ("none", None),
    ("pin", RetentionRequest(SYSTEM, None, 50)),
    ("ttl 60s", RetentionRequest(SYSTEM, 60.0, 0)),
    ("ttl 1s", RetentionRequest(SYSTEM, 1.0, 0)),
)


def workload(n: int, retention: RetentionRequest | None, seed: int = 0) -> list[SimRequest]:
    """`n` requests at RATE: one in EVERY is system prompt + question (with `retention`), the
    rest one-off prompts."""
    arrivals = arrival_times(np.random.default_rng(seed), n, RATE)
    kept = () if retention is None else (retention,)
    reqs = []
    for i in range(n):
        own = SYNTHETIC_CHUNK_BASE + 1 + i
        if i % EVERY == 0:
            chunks, ret = ((SYNTHETIC_CHUNK_BASE, SYSTEM), (own, QUESTION)), kept
        else:
            chunks, ret = ((own, ONE_OFF),), ()
        reqs.append(SimRequest(f"req-{i}", float(arrivals[i]), sum(c[1] for c in chunks), OUTPUT, chunks,
                               OUTPUT_CHUNK_BASE + i, retention=ret))
    return reqs


def retention_run(label: str, retention: RetentionRequest | None, n: int, seed: int) -> dict:
    """One variant's row: the system-prompt requests' hit rate and TTFT, and the retention counters."""
    cost, _ = roofline(MODEL, HARDWARE, block_size=BLOCK)
    cfg = SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_batched_tokens=2048, max_model_len=2048,
                          namespace=MODEL)
    reqs = workload(n, retention, seed)
    run = run_instance(reqs, cfg, cost)
    per_block = BLOCK * get_model(MODEL).kv_bytes_per_token()
    return {"retention": label, **system_prompt_hits(run, reqs),
            **retention_summary(run.instance.sched.kv.pool, per_block)}


def system_prompt_hits(run: InstanceRun, reqs: list[SimRequest]) -> dict:
    """Cached share of the system-prompt requests' prompts (the first never hits) and their TTFT."""
    by_id = {m.request_id: m for m in run.metrics}
    system = [by_id[r.request_id] for r in reqs if r.chunks[0][0] == SYNTHETIC_CHUNK_BASE]
    later = system[1:]
    return {"system_hit_rate": sum(m.cached_tokens for m in later) / max(sum(m.prompt_len for m in later), 1),
            "system_ttft_mean_s": sum(m.ttft for m in system) / len(system),
            "hit_rate": run.instance.sched.kv.stats.hit_rate}


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    n = 400 if check_size(size) else 60
    rows = [retention_run(label, r, n, seed) for label, r in VARIANTS]
    return ExperimentResult(
        "retention", "Retention: a pinned system prompt under cache pressure", rows,
        {"requests": n, "num_blocks": NUM_BLOCKS, "system_prompt_tokens": SYSTEM, "every": EVERY}, [],
        setup=(f"{MODEL} on one {HARDWARE}, a {NUM_BLOCKS}-block cache of {BLOCK}-token blocks; {n} requests at "
               f"{RATE:g}/s, one in {EVERY} a {SYSTEM}-token system prompt + {QUESTION}-token question asking to "
               f"retain the system prompt, the others {ONE_OFF}-token one-off prompts; {OUTPUT} tokens out each. "
               "system_hit_rate: cached share of the system-prompt requests' prompts after the first."),
        finding=("Unretained, the one-off prompts push the system prompt out between two of its uses (LRU), so "
                 "it is recomputed each time. Pinned, or with a TTL longer than the gap between uses (each use "
                 "extends it), it stays cached: the one-off blocks go first, and a pinned block goes (counted) "
                 "only when two one-off prompts in flight need more than every unretained block. A TTL shorter "
                 "than the gap expires first (counted) and the run behaves as unretained."),
    )
