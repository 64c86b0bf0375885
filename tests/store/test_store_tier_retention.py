"""The host and disk tiers evict by the device pool's retention rule (issue 32, item 1): blocks
without a live retention first in the tier's policy order, then retained ones lower priority
first, each such eviction counted; with no retention, exactly the policy's own order."""

from __future__ import annotations

import math
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block

from kvpool.core.retention import Retention, RetentionTable
from kvpool.store.disk import DiskTier
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.retained import TierRetention

PINNED = Retention(math.inf)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def block_bytes() -> int:
    store = TieredKVStore([HostTier(1 << 20)], NAMESPACE, SHAPE, DTYPE)
    store.save(h(0), make_block(0))
    return store.stats()["host"].used_bytes


@pytest.fixture(params=["host", "disk"])
def tiered(request, tmp_path):
    """A store of one tier holding 3 blocks, following `table` (None until something is retained)."""
    size = block_bytes()
    tier = HostTier(3 * size) if request.param == "host" else DiskTier(tmp_path / "d", 3 * size)
    store = TieredKVStore([tier], NAMESPACE, SHAPE, DTYPE)
    table = RetentionTable()
    store.follow_retention(lambda: table)
    yield store, tier, table
    store.close()


def held(store: TieredKVStore, n: int) -> set[int]:
    return {i for i in range(n) if store.lookup([h(i)])[0]}


def save(store: TieredKVStore, ids) -> None:
    for i in ids:
        assert store.save(h(i), make_block(i))


def test_a_pinned_block_survives_churn_that_evicts_an_unpinned_one(tiered):
    store, tier, table = tiered
    save(store, [0, 1, 2])
    table.retain([h(0)], PINNED)
    save(store, range(3, 12))
    assert held(store, 12) == {0, 10, 11}
    stats = tier.stats()
    assert stats.evictions == 9 and stats.pinned_evictions == 0


def test_a_block_retained_before_it_is_stored_is_kept(tiered):
    store, tier, table = tiered
    table.retain([h(5)], PINNED)
    save(store, range(12))
    assert 5 in held(store, 12) and tier.stats().pinned_evictions == 0


def test_an_expired_retention_no_longer_protects(tiered):
    store, tier, table = tiered
    table.retain([h(0)], Retention(until=10.0))
    save(store, [0, 1, 2, 3])
    assert held(store, 4) == {0, 2, 3}  # live at the engine's time: 1 went
    table.advance(10.0)
    save(store, [4])
    assert held(store, 5) == {2, 3, 4}  # 0 is the oldest again
    assert tier.stats().pinned_evictions == 0


def test_retained_blocks_go_lower_priority_first_and_each_is_counted(tiered):
    store, tier, table = tiered
    save(store, [0, 1, 2])
    table.retain([h(0)], Retention(math.inf, priority=5))
    table.retain([h(1)], Retention(math.inf, priority=1))
    table.retain([h(2)], Retention(math.inf, priority=9))
    save(store, [3])  # nothing unretained: the lowest priority goes
    assert held(store, 4) == {0, 2, 3}
    assert tier.stats().pinned_evictions == 1
    save(store, [4])  # the unretained block goes before any retained one
    assert held(store, 5) == {0, 2, 4}
    assert tier.stats().pinned_evictions == 1
    table.retain([h(4)], Retention(math.inf, priority=9))
    save(store, [5, 6])  # 0 (priority 5) goes, then the unretained 5
    assert held(store, 7) == {2, 4, 6}
    assert tier.stats().pinned_evictions == 2
    table.retain([h(6)], Retention(math.inf, priority=9))
    save(store, [7])  # among equal priorities, the policy's (LRU) order
    assert held(store, 8) == {4, 6, 7}
    stats = tier.stats()
    assert stats.pinned_evictions == 3 and stats.evictions == 5


def test_an_unpinned_block_is_evicted_in_policy_order_again(tiered):
    store, tier, table = tiered
    save(store, [0, 1, 2])
    table.retain([h(0)], PINNED)
    table.release([h(0)])
    save(store, [3])
    assert held(store, 4) == {1, 2, 3}


def test_pinned_evictions_are_counted_per_tier(tmp_path):
    """Write-back: the host tier's forced eviction demotes the block to the disk, which keeps
    it (room there); only the host counts a pinned eviction."""
    size = block_bytes()
    host, disk = HostTier(2 * size), DiskTier(tmp_path / "d", 8 * size)
    store = TieredKVStore([host, disk], NAMESPACE, SHAPE, DTYPE, write_policy="write-back")
    table = RetentionTable()
    store.follow_retention(lambda: table)
    table.retain([h(0), h(1), h(2)], PINNED)
    save(store, [0, 1, 2])
    assert host.stats().pinned_evictions == 1 and disk.stats().pinned_evictions == 0
    assert disk.contains(store.key(h(0))) and store.lookup([h(0), h(1), h(2)])[0] == 3
    store.close()


@pytest.mark.parametrize("policy", ["lfu", "fifo"])
def test_other_policies_order_the_unretained_and_forget_their_victims(policy, tmp_path):
    size = block_bytes()
    host = HostTier(3 * size, policy=policy)
    store = TieredKVStore([host], NAMESPACE, SHAPE, DTYPE)
    table = RetentionTable()
    store.follow_retention(lambda: table)
    save(store, [0, 1, 2])
    store.load([h(1)])  # LFU: 1 is used twice; FIFO: no change
    table.retain([h(0)], PINNED)
    save(store, [3])
    assert held(store, 4) == ({0, 1, 3} if policy == "lfu" else {0, 2, 3})
    save(store, [4])
    assert held(store, 5) == ({0, 1, 4} if policy == "lfu" else {0, 3, 4})
    table.release([h(0)])
    save(store, [2])  # 0 goes now; 2 was evicted: its count / place was forgotten, it comes back new
    assert held(store, 5) == ({1, 2, 4} if policy == "lfu" else {2, 3, 4})
    save(store, [5])
    assert held(store, 6) == ({1, 2, 5} if policy == "lfu" else {2, 4, 5})
    assert host.stats().used_bytes == 3 * size


def test_keys_of_another_namespace_are_never_retained():
    table = RetentionTable()
    table.retain([h(7)], PINNED)
    view = TierRetention(lambda: table, "kv3:aaaa:").lookup()
    assert view("kv3:aaaa:" + h(7).hex()) == PINNED
    assert view("kv3:aaaa:int4:" + h(7).hex()) == PINNED
    assert view("kv3:bbbb:" + h(7).hex()) is None
    assert view("kv3:aaaa:not-hex") is None
    assert TierRetention(lambda: None, "kv3:aaaa:").lookup() is None
    assert TierRetention(lambda: RetentionTable(), "kv3:aaaa:").lookup() is None


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["lru", "lfu", "fifo"]),
       st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(1, 120)), max_size=80))
def test_an_empty_table_evicts_exactly_as_no_table(policy, ops):
    """With a table that retains nothing (or only keys never stored) a tier's state after any
    puts and gets is the one without retention."""
    plain, followed = HostTier(400, policy), HostTier(400, policy)
    table = RetentionTable()
    table.retain([h(99)], PINNED)  # non-empty: the retention path runs, retaining none of these
    followed.retention = TierRetention(lambda: table, "")
    for is_get, key, size in ops:
        k = h(key).hex()
        for tier in (plain, followed):
            if is_get:
                tier.get(k)
            else:
                tier.put(k, b"x" * size)
    assert plain.present_keys() == followed.present_keys()
    assert plain.stats().evictions == followed.stats().evictions
    assert followed.stats().pinned_evictions == 0


def test_workers_evict_while_the_engine_thread_changes_the_table(tmp_path):
    """The table changes (retain, release, advance) on one thread while two store workers save:
    nothing raises, the budget holds, a block pinned throughout stays."""
    size = block_bytes()
    host = HostTier(6 * size)
    store = TieredKVStore([host], NAMESPACE, SHAPE, DTYPE, workers=2)
    table = RetentionTable()
    store.follow_retention(lambda: table)
    table.retain([h(0)], Retention(math.inf, priority=100))  # above every churning retention
    save(store, [0])
    stop = threading.Event()

    def engine_thread() -> None:
        rng, now = random.Random(0), 0.0
        while not stop.is_set():
            now += 0.01
            keys = [h(rng.randrange(1, 400)) for _ in range(20)]
            table.retain(keys, Retention(now + rng.random(), rng.randrange(0, 5)))
            table.release(keys[:5])
            table.advance(now)

    t = threading.Thread(target=engine_thread)
    t.start()
    try:
        futures = [store.save_async(h(i), make_block(i % 7)) for i in range(1, 400)]
        assert all(f.result() for f in futures)
    finally:
        stop.set()
        t.join()
    stats = host.stats()
    assert stats.used_bytes <= stats.capacity_bytes and stats.evictions >= 390
    assert store.lookup([h(0)])[0] == 1
    store.close()
