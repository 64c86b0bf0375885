"""Experiment 8: prefix-cache hit rate vs cache capacity on the Mooncake conversation trace,
LRU vs LFU vs FIFO, against the unlimited-capacity bound (a brute-force set computation).

Each request's prompt is looked up in and then stored into one KV manager (the real block
pool and eviction policies); the request's blocks are released at once, so capacity alone
decides what stays cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvpool.core.hashing import BlockHash
from kvpool.core.kv_manager import KVCacheManager
from kvpool.sim.experiments.base import ExperimentResult, check_size
from kvpool.sim.plots import plot_lines
from kvpool.sim.tokens import BlockHasher, TokenSynth
from kvpool.sim.traces import TraceOptions, load_mooncake_trace

BLOCK = 512  # the trace's own hash granularity, replayed natively
POLICIES = ("lru", "lfu", "fifo")
FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0)
# Lecture §8.4: LRU beats LFU on this trace; the trace's reuse ceiling is ~0.37 (issue 17).
PUBLISHED = "LRU > LFU; ceiling ~0.37 (lecture §8.4)"


def unlimited_hit_rate(prompts: Sequence[tuple[int, list[BlockHash]]], block_size: int) -> float:
    """Hit tokens over prompt tokens when nothing is ever evicted: a plain set of hashes."""
    seen: set[BlockHash] = set()
    hit = total = 0
    for prompt_len, hashes in prompts:
        usable = (prompt_len - 1) // block_size
        n = 0
        while n < min(usable, len(hashes)) and hashes[n] in seen:
            n += 1
        hit += n * block_size
        total += prompt_len
        seen.update(hashes)
    return hit / max(total, 1)


def cache_hit_rate(prompts: Sequence[tuple[int, list[BlockHash]]], num_blocks: int, policy: str,
                   block_size: int) -> float:
    """Replay prompts through a real KV manager of `num_blocks` blocks."""
    kv = KVCacheManager(num_blocks, block_size, eviction_policy=policy)
    for prompt_len, hashes in prompts:
        need = -(-prompt_len // block_size)
        if need > num_blocks:  # larger than the whole cache: count the miss, cache nothing
            kv.stats.queries_tokens += prompt_len
            continue
        tokens = [0] * prompt_len
        kv.allocate(0, tokens, block_hashes=hashes)
        kv.commit(0, tokens, prompt_len)
        kv.free(0)
    return kv.stats.hit_rate


def trace_prompts(num_requests: int | None, block_size: int = BLOCK) -> list[tuple[int, list[BlockHash]]]:
    reqs = load_mooncake_trace("conversation", TraceOptions(max_requests=num_requests))
    hasher = BlockHasher(block_size, TokenSynth())
    return [(r.prompt_len, hasher.hashes(r.chunks)) for r in reqs]


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    prompts = trace_prompts(None if full else 1500)
    distinct = len({h for _, hs in prompts for h in hs})
    bound = unlimited_hit_rate(prompts, BLOCK)
    rows = []
    series: dict[str, list[float]] = {p: [] for p in POLICIES}
    for frac in FRACTIONS:
        blocks = max(int(distinct * frac), 1)
        row: dict = {"capacity_fraction": frac, "capacity_blocks": blocks}
        for p in POLICIES:
            row[p] = cache_hit_rate(prompts, blocks, p, BLOCK)
            series[p].append(row[p])
        row["unlimited"] = bound
        row["published"] = PUBLISHED
        rows.append(row)
    at = {r["capacity_fraction"]: r for r in rows}
    plots = []
    if out is not None:
        series["unlimited"] = [bound] * len(FRACTIONS)
        plots.append(plot_lines(list(FRACTIONS), series, out / "prefix_hit_rate.png",
                                "cache capacity (fraction of distinct prompt blocks)", "prefix hit rate",
                                "Prefix hit rate vs capacity, Mooncake conversation trace"))
    return ExperimentResult(
        "prefix_hit_rate", "Prefix cache hit rate vs capacity (LRU / LFU / FIFO)", rows,
        {"requests": len(prompts), "distinct_blocks": distinct, "unlimited_hit_rate": bound,
         "block_size": BLOCK, "seed_unused": seed},
        plots,
        setup=(f"{'The whole' if full else 'The first ' + str(len(prompts)) + ' requests of the'} Mooncake "
               f"conversation trace ({len(prompts)} requests), {BLOCK}-token blocks (the trace's own hash "
               f"granularity); one KV manager whose capacity is a fraction of the {distinct} distinct prompt "
               "blocks; each prompt is matched, stored and released in arrival order, so capacity alone decides "
               "what stays cached."),
        finding=("Hit rate grows with capacity and approaches the unlimited bound, the share of prompt tokens "
                 f"that repeat an earlier prefix ({bound:.2f} here; 0.37 on the whole trace). On the whole trace LRU "
                 f"beats LFU from 5% of the distinct blocks up (here {at[0.05]['lru']:.2f} vs {at[0.05]['lfu']:.2f} "
                 f"at 5%, {at[0.1]['lru']:.2f} vs {at[0.1]['lfu']:.2f} at 10%), as the lecture says: a conversation's next turn comes minutes after the last, so recency predicts reuse, while "
                 "LFU keeps blocks that were hit often long ago and evicts the fresh context of live sessions "
                 "(a new block has count 1). Only at 2% does LFU edge ahead, where little but the most shared "
                 "prefixes fit. FIFO trails LRU: it evicts a hot prefix as soon as it is old."),
        published=("Lecture §8.4: LRU beats LFU on the conversation trace; issue 17 puts the trace's reuse "
                   "ceiling at ~0.37 (published column). Both hold on the whole trace: the unlimited bound is "
                   "0.373 and LRU leads LFU from 5% of the distinct blocks up."),
    )
