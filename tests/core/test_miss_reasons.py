"""Every prompt token gets a source or a miss reason, decided in the core from scenarios that
really cause each: a tiny pool (eviction), two salts, a sliding-window model, a store whose tiers
hold the blocks, a store block that fails its check."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import pytest

from kvpool.core.hashing import BlockHash
from kvpool.core.miss_reasons import (
    DEVICE,
    DIFFERENT_SALT,
    FIRST_SEEN,
    INTEGRITY,
    OUTSIDE_WINDOW,
    PARTIAL_BLOCK,
    UNCACHEABLE,
    MissLedger,
    PromptSources,
    RecentHashes,
    evicted_from,
)
from kvpool.sched.output import KVLoad, Sample
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig

B = 4


class Store:
    """A store stand-in: which tier holds each block (by key)."""

    def __init__(self) -> None:
        self.held: dict[BlockHash, str] = {}

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return n

    def tiers_of(self, keys: Sequence[BlockHash]) -> list[str]:
        return [self.held[k] for k in keys]


class Driver:
    """The scheduler with a ledger, stepped with placeholder tokens; `land(load)` says how many
    blocks of each store load arrive and why the rest did not."""

    def __init__(self, num_blocks: int = 64, store: Store | None = None, tiers: Sequence[str] = (),
                 land: Callable[[KVLoad], tuple[int, str]] | None = None, **cfg) -> None:
        self.s = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=B, max_num_batched_tokens=64, **cfg),
                           external_kv=store.lookup if store else None)
        kv = self.s.kv
        kv.ledger = MissLedger(B, kv.namespace, kv.pool.lookup, kv.windowed, tiers,
                               store.tiers_of if store else None)
        self.land = land or (lambda load: (len(load.hashes), ""))
        self.next_token = 10_000

    def run(self, prompt: list[int], salt: str | None = None, max_tokens: int = 1, **params) -> PromptSources:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
        g = SequenceGroup(f"r{self.next_token}", [self.s.new_sequence(prompt)], sp, 0.0, cache_salt=salt)
        self.s.add_request(g)
        while self.s.has_unfinished():
            out = self.s.schedule()
            for load in out.kv_loads:
                n, why = self.land(load)
                self.s.finish_kv_load(load, n, why) if why else self.s.finish_kv_load(load, n)
            samples = []
            for _ in out.sampling:
                self.next_token += 1
                samples.append(Sample([self.next_token]))
            self.s.postprocess(out, samples)
        assert g.prompt_sources is not None
        return g.prompt_sources


def split(p: PromptSources) -> tuple[dict[str, int], dict[str, int]]:
    total = sum(p.sources.values()) + sum(p.misses.values())
    assert total == p.prompt_len, (p.sources, p.misses)
    return p.sources, p.misses


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_first_seen_then_device_hit_and_the_partial_last_block():
    d = Driver()
    prompt = tokens(1, 10)  # 2 full blocks a hit can reach, 2 tokens past them
    assert split(d.run(prompt)) == ({}, {FIRST_SEEN: 8, PARTIAL_BLOCK: 2})
    assert split(d.run(prompt)) == ({DEVICE: 8}, {PARTIAL_BLOCK: 2})
    # a prompt ending on a block boundary always computes its last block (its last token)
    assert split(d.run(tokens(1, 12))) == ({DEVICE: 8}, {PARTIAL_BLOCK: 4})


def test_a_tiny_pool_evicts_and_the_miss_says_so():
    d = Driver(num_blocks=6)
    a = tokens(1, 17)
    d.run(a)
    d.run(tokens(500, 17))  # 5 blocks: pushes a's cached blocks out of a 6-block pool
    assert d.s.kv.pool.num_evictions > 0
    sources, misses = split(d.run(a))
    assert misses.get(evicted_from(DEVICE), 0) == 16 - sources.get(DEVICE, 0) > 0
    assert FIRST_SEEN not in misses


def test_the_same_tokens_under_another_salt_or_none():
    d = Driver()
    doc = tokens(1, 16)
    d.run(doc + tokens(900, 5), salt="tenant-a")
    sources, misses = split(d.run(doc + tokens(700, 5), salt="tenant-b"))
    assert sources == {}
    assert misses == {DIFFERENT_SALT: 16, FIRST_SEEN: 4, PARTIAL_BLOCK: 1}  # its own question is new
    _, misses = split(d.run(doc + tokens(600, 1)))  # unsalted, the doc cached under salts only
    assert misses == {DIFFERENT_SALT: 16, PARTIAL_BLOCK: 1}
    assert split(d.run(doc + tokens(900, 5), salt="tenant-a"))[0] == {DEVICE: 20}


def test_a_window_layer_group_that_left_the_window_is_the_reason():
    # full attention + an 8-token window; a's window blocks are freed (cached, evictable) as its
    # prefill passes them, so a later allocation evicts them before any full-attention block
    d = Driver(num_blocks=30, kv_group_windows=(None, 8), enable_chunked_prefill=True, max_num_seqs=4)
    a = tokens(1, 40)
    d.run(a)
    d.run(tokens(500, 40))  # 20 more blocks in a 30-block pool: the 10 evicted are a's window blocks
    kv = d.s.kv
    shared = kv.prompt_hashes(a[:20])
    assert all(kv.pool.lookup(h) is not None for h in shared)  # the full group still holds a's first 20
    sources, misses = split(d.run(a[:20] + tokens(300, 9)))
    assert sources == {}
    assert misses == {OUTSIDE_WINDOW: 20, FIRST_SEEN: 8, PARTIAL_BLOCK: 1}


def test_store_hits_by_tier_and_a_block_that_fails_its_check():
    store = Store()
    d = Driver(store=store, tiers=("host", "disk"))
    prompt = tokens(1, 21)
    hashes = d.s.kv.prompt_hashes(prompt)
    for i, h in enumerate(hashes[:4]):
        store.held[h] = "host" if i < 2 else "disk"
    assert split(d.run(prompt)) == ({"host": 8, "disk": 8}, {FIRST_SEEN: 4, PARTIAL_BLOCK: 1})

    d = Driver(store=store, tiers=("host", "disk"), land=lambda load: (1, INTEGRITY))
    assert split(d.run(prompt)) == ({"host": 4}, {INTEGRITY: 12, FIRST_SEEN: 4, PARTIAL_BLOCK: 1})


def test_evicted_from_the_store_names_its_last_tier():
    store = Store()
    d = Driver(num_blocks=6, store=store, tiers=("host", "disk"))
    a = tokens(1, 17)
    d.run(a)
    d.run(tokens(500, 17))  # evicts a from the device; the store never got it (or lost it)
    _, misses = split(d.run(a))
    assert misses.get(evicted_from("disk"), 0) > 0 and evicted_from(DEVICE) not in misses


def test_prompt_logprobs_read_no_cache():
    d = Driver()
    d.run(tokens(1, 10))
    assert split(d.run(tokens(1, 10), prompt_logprobs=0)) == ({}, {UNCACHEABLE: 10})


def test_recent_hashes_is_bounded_and_forgets_the_oldest():
    def digest(i: int, tag: str) -> bytes:
        return hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest()

    r = RecentHashes(capacity=100, bits=1 << 16)
    first = [digest(i, "a") for i in range(100)]
    r.add_all(first)
    assert all(h in r for h in first)
    later = [digest(i, "b") for i in range(250)]
    r.add_all(later)
    assert not any(h in r for h in first)  # two generations past: gone
    assert all(h in r for h in later[-100:])
    assert sum(digest(i, "c") in r for i in range(1000)) <= 2  # false positives: ~0.0005% per probe here
    with pytest.raises(ValueError, match="power of two"):
        RecentHashes(bits=1000)
