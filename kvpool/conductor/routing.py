"""Prefill-side choice: a TTFT estimate per prefill instance, and the policies that pick one.

TTFT(p) = queue(p) + prefill(prompt tokens p lacks, on top of those it holds). kv-centric
also weighs pulling a longer prefix from another holder (or the pool) when that prefix is at
least `replication_threshold` times the one p holds:
TTFT_pull(p) = transfer(missing blocks) + queue(p) + prefill(tokens beyond the pulled prefix).

Retention (the index's `retained_match`) only breaks ties: between instances holding the same
prefix (cache-aware) or with the same estimate (kv-centric), and between pull sources of the same
length, the one that retains it wins, because it is the copy its instance evicts last. It never
outweighs a longer prefix, a shorter queue or a smaller TTFT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool.conductor.index import POOL
from kvpool.conductor.predictor import StepTimePredictor


@dataclass(frozen=True, slots=True)
class PrefillOption:
    """One prefill instance's estimate for one request. `order` is its configured position
    (the final tie-break, so every choice is deterministic)."""

    instance_id: str
    order: int
    queued_tokens: int
    own_blocks: int
    ttft: float
    cached_blocks: int
    pull_from: str | None = None
    pull_blocks: int = 0
    held_blocks: int = 0  # all blocks the instance caches: cache-aware ties go to the emptiest
    busy: int = 0  # requests running on or promised to it: least-load ties go to the idlest
    retained_blocks: int = 0  # of own_blocks, those it holds under a live retention


def usable_blocks(blocks: int, prompt_len: int, block_size: int) -> int:
    """Cached blocks a prefill can reuse: whole blocks, leaving at least the last prompt
    token to compute (its logits are needed for the first output token)."""
    return min(blocks, (prompt_len - 1) // block_size)


def _best_sources(match: Mapping[str, int], queued: Mapping[str, int],
                  retained: Mapping[str, int]) -> list[tuple[str, int]]:
    """The two best holders: longest prefix, then the pool (it serves no compute), then the
    one retaining more of it, then the least-queued instance, then by id."""
    ranked = sorted(
        match.items(),
        key=lambda kv: (-kv[1], kv[0] != POOL, -retained.get(kv[0], 0), queued.get(kv[0], 0), kv[0]),
    )
    return ranked[:2]


def estimate_options(
    prompt_len: int,
    match: Mapping[str, int],
    candidates: Sequence[tuple[int, str]],
    queued: Mapping[str, int],
    predictor: StepTimePredictor,
    block_size: int,
    replication_threshold: float | None,
    held: Mapping[str, int] | None = None,
    busy: Mapping[str, int] | None = None,
    pull_from_peers: bool = False,
    retained: Mapping[str, int] | None = None,
) -> list[PrefillOption]:
    """Options for each (order, instance id) candidate. `replication_threshold` None disables
    pulls (every policy but kv-centric computes only with what an instance holds); without
    `pull_from_peers` only the pool is a pull source. `held` is how many blocks each instance
    caches in all, `busy` how many requests it runs, `retained` how many of the prompt's leading
    blocks it holds under a live retention."""
    retained = retained or {}
    holders = match if pull_from_peers else {k: v for k, v in match.items() if k == POOL}
    sources = _best_sources(holders, queued, retained) if replication_threshold is not None else []
    options = []
    for order, inst in candidates:
        q = queued.get(inst, 0)
        queue_s = predictor.prefill_time(q, 0)
        own = usable_blocks(match.get(inst, 0), prompt_len, block_size)
        cached = own * block_size
        ttft = queue_s + predictor.prefill_time(prompt_len - cached, cached)
        h = held.get(inst, 0) if held else 0
        b = busy.get(inst, 0) if busy else 0
        kept = min(retained.get(inst, 0), own)
        option = PrefillOption(inst, order, q, own, ttft, own, held_blocks=h, busy=b, retained_blocks=kept)
        src = next((s for s in sources if s[0] != inst), None)
        if src is not None:
            best = usable_blocks(src[1], prompt_len, block_size)
            if best > own and best >= replication_threshold * own:
                pulled = best * block_size
                ttft_pull = (
                    predictor.transfer_time(best - own)
                    + queue_s
                    + predictor.prefill_time(prompt_len - pulled, pulled)
                )
                if ttft_pull < ttft:
                    option = PrefillOption(inst, order, q, own, ttft_pull, best, src[0], best - own, h, b, kept)
        options.append(option)
    return options


def least_load(options: Sequence[PrefillOption]) -> PrefillOption:
    """Smallest prefill queue; ties (idle queues are common at moderate load) go to the
    instance running the fewest requests, so a colocated instance busy decoding is not
    taken for idle."""
    return min(options, key=lambda o: (o.queued_tokens, o.busy, o.order))


def cache_aware(options: Sequence[PrefillOption]) -> PrefillOption:
    """Longest prefix held; ties go to the instance retaining more of it, then to the least
    loaded, then to the emptiest cache, so that new prefixes spread over the instances instead
    of piling onto the first idle one."""
    return min(options, key=lambda o: (-o.own_blocks, -o.retained_blocks, o.queued_tokens, o.held_blocks, o.order))


def kv_centric(options: Sequence[PrefillOption]) -> PrefillOption:
    """Smallest estimated TTFT (pulls included); ties as in cache_aware."""
    return min(options, key=lambda o: (o.ttft, -o.retained_blocks, o.queued_tokens, o.held_blocks, o.order))
