"""`receive` (KV computed elsewhere lands cached): the blocks stay cached and evictable, a later
prompt hits them, and a short memory writes nothing (the receiver recomputes)."""

from __future__ import annotations

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
