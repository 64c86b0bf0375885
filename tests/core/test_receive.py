"""`receive` (KV computed elsewhere lands cached): the blocks stay cached and evictable, a later
prompt hits them, and a short memory writes nothing (the receiver recomputes)."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.kv_manager import KVCacheManager
from kvpool.core.receive import receive

B = 4
HASHES = [bytes([i]) * 16 for i in range(5)]


def test_received_blocks_stay_cached_and_a_later_prompt_hits_them():
    kv = KVCacheManager(8, B, record_events=True)
    assert receive(kv, HASHES[:3]) == 3
    assert not kv.seqs and kv.pool.num_free == 8  # cached blocks are evictable: all free for allocation
    assert kv.drain_events().stored == HASHES[:3]
    assert kv.match_prefix(HASHES, 5 * B + 1).num_tokens == 3 * B
    assert receive(kv, HASHES) == 5  # the first three hit, two more are written
    assert kv.match_prefix(HASHES, 5 * B + 1).num_tokens == 5 * B


def test_receive_writes_nothing_when_memory_is_short():
    kv = KVCacheManager(4, B)
    assert receive(kv, HASHES[:4]) == 0  # 4 blocks plus the one-token block do not fit
    assert receive(kv, []) == 0
    assert kv.pool.num_free == 4 and not kv.pool.cached_items()


def _received_by_a_sequence(kv: KVCacheManager, hashes: list) -> int:
    """What `receive` stands for: a sequence holding the blocks, committed and freed."""
    n = len(hashes)
    if n == 0 or n + 1 > kv.num_free_blocks:
        return 0
    tokens = range(n * kv.block_size + 1)
    kv.allocate(-1, tokens, block_hashes=hashes)
    kv.commit(-1, tokens, n * kv.block_size)
    kv.free(-1)
    return n


def _eviction_order(policy) -> list:
    victims = copy.deepcopy(policy)
    return victims.pop_victims(len(victims))


def _state(kv: KVCacheManager) -> tuple:
    p = kv.pool
    ev = p.drain_events()
    return (p.ref_counts, p.block_tokens, p.block_hashes, p.block_salts, p._free, _eviction_order(p._evictable),
            p.cached_items(), p.tokens_in_use, p.num_evictions, ev.stored, ev.evicted, ev.evicted_block_ids,
            kv.stats, sorted(kv.seqs))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("receive", "hold", "drop")),
                          st.lists(st.integers(0, 11), min_size=0, max_size=7)), max_size=14),
       st.sampled_from(("lru", "lfu", "fifo")))
def test_one_pass_receive_leaves_the_state_a_receiving_sequence_leaves(ops, policy):
    """Hits idle and in use, blocks taken free or evicted, contents already cached elsewhere in
    the pool (a duplicate stays private and is freed), the same content twice in one transfer:
    every list, the free list's order, the eviction order and the events are the same."""
    fast, slow = (KVCacheManager(10, B, eviction_policy=policy, record_events=True) for _ in range(2))
    held = []
    for i, (op, names) in enumerate(ops):
        hashes = [bytes([h]) * 16 for h in names]
        if op == "receive":
            assert receive(fast, hashes) == _received_by_a_sequence(slow, hashes)
        elif op == "hold":  # a running sequence: its blocks in use, some shared with received ones
            tokens = range(len(hashes) * B + 1)
            if all(kv.blocks_needed(len(tokens), kv.match_prefix(hashes, len(tokens))) <= kv.num_free_blocks
                   for kv in (fast, slow)):
                for kv in (fast, slow):
                    kv.allocate(i, tokens, block_hashes=hashes)
                    kv.commit(i, tokens, len(hashes) * B)
                held.append(i)
        elif held:
            seq = held.pop(0)
            fast.free(seq)
            slow.free(seq)
        assert _state(fast) == _state(slow)
