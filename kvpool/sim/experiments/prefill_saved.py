"""Experiment 9: prefill compute prefix caching saves on the Mooncake conversation trace, for
LLaMA2-70B on 8 A800s, per cache capacity — and the storage each capacity needs.

Prompts are matched, stored and released in arrival order through one KV manager (LRU), as
in the hit-rate experiment; each request's saving is its prefill time without the cache minus
its prefill time for the uncached suffix (roofline, each prefill costed alone).
"""

from __future__ import annotations

from pathlib import Path

from kvpool.core.kv_manager import KVCacheManager
from kvpool.costs.cost_model import RooflineCostModel
from kvpool.costs.presets import get_hardware, get_model
from kvpool.sim.experiments.base import ExperimentResult, check_size
from kvpool.sim.plots import plot_lines
from kvpool.sim.tokens import BlockHasher, TokenSynth
from kvpool.sim.traces import TraceOptions, load_mooncake_trace

BLOCK = 512  # the trace's own hash granularity, replayed natively
CAPACITIES = (1_000, 3_000, 10_000, 30_000, None)  # blocks; None: every distinct block (unlimited)
# Lecture §8.5 (Mooncake conversation trace, LLaMA2-70B on 8 A800s): prefill speedup from caching.
PUBLISHED_SPEEDUP = {1_000: 1.46, 10_000: 2.34, None: 2.46}


def prefill_saved(prompts: list[tuple[int, list]], capacity_blocks: int, cost: RooflineCostModel) -> dict:
    kv = KVCacheManager(capacity_blocks, BLOCK)
    full = cached = 0.0
    hit_tokens = 0
    for prompt_len, hashes in prompts:
        t = cost.compute_time([prompt_len], [prompt_len])
        full += t
        if -(-prompt_len // BLOCK) > capacity_blocks:
            cached += t
            continue
        tokens = [0] * prompt_len
        hit = kv.allocate(0, tokens, block_hashes=hashes)
        kv.commit(0, tokens, prompt_len)
        kv.free(0)
        hit_tokens += hit
        cached += cost.compute_time([prompt_len - hit], [prompt_len])
    return {"hit_tokens": hit_tokens, "prefill_s": full, "prefill_cached_s": cached}


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    full = check_size(size)
    model, hw = get_model("llama2-70b"), get_hardware("a800-80gb")
    cost = RooflineCostModel(model, hw, tp=8, block_size=BLOCK)
    reqs = load_mooncake_trace("conversation", TraceOptions(max_requests=None if full else 3000))
    hasher = BlockHasher(BLOCK, TokenSynth())
    prompts = [(r.prompt_len, hasher.hashes(r.chunks)) for r in reqs]
    distinct = len({h for _, hs in prompts for h in hs})
    block_bytes = BLOCK * model.kv_bytes_per_token()
    prompt_tokens = sum(p for p, _ in prompts)
    rows = []
    for cap in CAPACITIES:
        blocks = distinct if cap is None else cap
        res = prefill_saved(prompts, blocks, cost)
        rows.append({"capacity": "unlimited" if cap is None else cap, "capacity_blocks": blocks,
                     "storage_tib": blocks * block_bytes / 2**40,
                     "hit_rate": res["hit_tokens"] / prompt_tokens,
                     "prefill_saved": 1 - res["prefill_cached_s"] / res["prefill_s"],
                     "speedup": res["prefill_s"] / res["prefill_cached_s"],
                     "published_speedup": PUBLISHED_SPEEDUP.get(cap),
                     "gpu_hours_saved": (res["prefill_s"] - res["prefill_cached_s"]) * 8 / 3600})
    plots = []
    if out is not None:
        plots.append(plot_lines([r["storage_tib"] for r in rows],
                                {"prefill compute saved": [r["prefill_saved"] for r in rows],
                                 "prompt tokens hit": [r["hit_rate"] for r in rows]},
                                out / "prefill_saved.png", "cache capacity (TiB of KV)", "fraction",
                                "Prefill saved by prefix caching, LLaMA2-70B, Mooncake trace"))
    return ExperimentResult(
        "prefill_saved", "Prefill compute saved by prefix caching vs cache capacity (Mooncake trace)", rows,
        {"requests": len(reqs), "distinct_blocks": distinct, "capacities": list(CAPACITIES), "block_tokens": BLOCK, "block_bytes": block_bytes,
         "prompt_tokens": prompt_tokens}, plots,
        setup=(f"{'The whole' if full else 'The first ' + str(len(reqs)) + ' requests of the'} Mooncake conversation "
               f"trace ({len(reqs)} requests); LLaMA2-70B on 8 A800s (roofline, tensor parallel); {BLOCK}-token "
               f"blocks (the trace's own) of {block_bytes / 2**20:.0f} MiB of KV; one LRU cache of 1k-30k blocks or "
               f"every one of the {distinct} distinct prompt blocks (unlimited). Each prefill is costed alone: "
               "without the cache all its tokens, with it the uncached suffix, whose attention still covers the "
               "cached prefix. speedup = prefill time without / with the cache; storage_tib the KV the capacity holds."),
        finding=("Compute saved tracks the share of prompt tokens hit, a little below it: the uncached suffix "
                 "still attends to the whole cached prefix (charging it only its own tokens' attention would "
                 "overstate the saving). Capacity matters up to ~10k blocks; past that the trace's reuse ceiling "
                 "binds. The lecture's speedups (1.46x / 2.34x / 2.46x) need 32% / 57% / 59% of prefill removed, "
                 "and the last two exceed what this trace can give under any cost model: its brute-force reuse "
                 "ceiling (every prompt block seen before, nothing evicted) is the unlimited row's hit rate. "
                 "Holding the reusable prefixes takes tens of TiB of KV, far more than HBM: only a DRAM/SSD pool "
                 "such as Mooncake Store reaches the high end."),
        published=("Lecture §8.5 (Mooncake conversation trace, LLaMA2-70B on 8 A800s): prefill speedup 1.46x "
                   "at 1k blocks, 2.34x at 10k, 2.46x unlimited (published_speedup). kvpool's speedups are lower "
                   "at every capacity, and the published 2.34x and 2.46x (57-59% of prefill removed) are above "
                   "this trace's brute-force reuse ceiling of 37% of prompt tokens, which no cost model can exceed: "
                   "they must come from another trace or count reuse differently. The 1k-block figure also differs: an LRU of 1k 512-token blocks holds ~40 "
                   "conversations of ~12k tokens, too few for the trace's minutes-long turn gaps."),
    )
