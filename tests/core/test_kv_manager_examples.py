"""Worked examples of the KV manager's contract, small enough to check by hand."""

import subprocess
import sys

import pytest

from kvpool.core.hashing import hash_blocks
from kvpool.core.kv_manager import KVCacheManager
from kvpool.errors import ConfigError, KVStateError, OutOfBlocks, UnknownSequence

WORDS = ["Four", "score", "and", "seven", "years", "ago", "our"]


def test_seven_token_prompt_takes_two_blocks_and_third_only_at_ninth_token():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    kv.allocate(0, list(range(len(WORDS))))
    assert len(kv.block_table(0)) == 2
    kv.append_slots(0)  # 8th token ("fathers") fills block 2's free slot
    assert len(kv.block_table(0)) == 2
    assert kv.usage().empty_slots == 0
    kv.append_slots(0)  # 9th token needs block 3
    assert len(kv.block_table(0)) == 3
    assert kv.usage().empty_slots == 3


@pytest.mark.parametrize("n", [2, 4, 6])
def test_n_samples_from_partial_prompt_cost_n_minus_one_copies(n):
    kv = KVCacheManager(num_blocks=64, block_size=16)
    kv.allocate(0, list(range(100)))  # 6 full blocks + 4 tokens
    for child in range(1, n):
        kv.fork(0, child)
    copies = [c for sid in range(n) for c in kv.append_slots(sid)]
    assert len(copies) == n - 1
    # every full block is still shared by all n samples
    assert all(kv.pool.blocks[b].ref_count == n for b in kv.block_table(0)[:6])


def test_n_samples_from_whole_block_prompt_need_no_copy():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    kv.allocate(0, list(range(96)))
    for child in range(1, 4):
        kv.fork(0, child)
    assert [c for sid in range(4) for c in kv.append_slots(sid)] == []


def test_changing_one_token_of_block_three_changes_hashes_three_to_five_only():
    tokens = list(range(5 * 16))
    changed = list(tokens)
    changed[2 * 16 + 5] += 1000
    a, b = hash_blocks(tokens, 16), hash_blocks(changed, 16)
    assert [x == y for x, y in zip(a, b, strict=True)] == [True, True, False, False, False]


def test_hashes_are_stable_across_processes():
    # Two fresh interpreters with different PYTHONHASHSEED agree with this one.
    code = "from kvpool.core.hashing import hash_blocks; print(hash_blocks([1,2,3,4], 4, 'm', 's')[0].hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout
        for seed in (1, 2)
    }
    assert outs == {hash_blocks([1, 2, 3, 4], 4, "m", "s")[0].hex() + "\n"}


def test_different_salts_and_namespaces_never_share():
    t = list(range(64))
    assert hash_blocks(t, 16, cache_salt="a") != hash_blocks(t, 16, cache_salt="b")
    assert set(hash_blocks(t, 16, namespace="m1")).isdisjoint(hash_blocks(t, 16, namespace="m2"))
    kv = KVCacheManager(num_blocks=16, block_size=16)
    kv.allocate(0, t, cache_salt="tenant-a")
    kv.commit(0, t, 64)
    kv.free(0)
    assert kv.allocate(1, t + [1], cache_salt="tenant-b") == 0
    assert kv.allocate(2, t + [1], cache_salt="tenant-a") == 64


def test_finished_sequence_blocks_are_reused_and_last_prompt_token_recomputed():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    kv.allocate(0, prompt)
    kv.commit(0, prompt, 12)
    kv.free(0)
    assert kv.usage().cached_blocks == 3
    assert kv.allocate(1, prompt) == 8  # the whole prompt is cached, the last block is recomputed
    assert kv.allocate(2, prompt + [99]) == 12
    assert kv.stats.hits_tokens == 20 and kv.stats.queries_tokens == 37


def test_cached_blocks_are_evicted_lru_only_when_memory_is_needed():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    for sid, base in ((0, 0), (1, 100)):
        toks = list(range(base, base + 8))
        kv.allocate(sid, toks)
        kv.commit(sid, toks, 8)
        kv.free(sid)
    assert kv.usage().cached_blocks == 4 and kv.num_free_blocks == 4
    kv.allocate(2, list(range(500, 508)))  # evicts the two oldest (sequence 0's)
    assert kv.match_prefix(kv.prompt_hashes(list(range(8)) + [0]), 9).num_tokens == 0
    assert kv.match_prefix(kv.prompt_hashes(list(range(100, 108)) + [0]), 9).num_tokens == 8


def test_a_table_made_of_evicted_blocks_takes_them_in_id_order():
    """The policy picks the victims; their ids go to the new table ascending, so a long run keeps
    each table's blocks neighbours in memory (in LRU order they scatter: a freed table goes into
    the order tail first, and tables freed in turn interleave)."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    for sid, base in ((0, 0), (1, 100)):
        toks = list(range(base, base + 16))
        kv.allocate(sid, toks)
        kv.commit(sid, toks, 16)
    assert kv.block_table(0) == [0, 1, 2, 3] and kv.block_table(1) == [4, 5, 6, 7]
    kv.free(1)
    kv.free(0)  # LRU order now 7, 6, 5, 4, 3, 2, 1, 0
    kv.allocate(2, list(range(500, 520)))  # 5 blocks, all evicted: sequence 1's four, then block 3
    assert kv.block_table(2) == [3, 4, 5, 6, 7]
    assert kv.match_prefix(kv.prompt_hashes(list(range(12)) + [0]), 13).num_tokens == 12  # blocks 0-2 kept


def test_lfu_keeps_the_popular_prefix():
    kv = KVCacheManager(num_blocks=4, block_size=4, eviction_policy="lfu")
    hot, cold = list(range(4)), list(range(100, 104))
    sid = 0
    for toks, times in ((hot, 3), (cold, 1)):
        for _ in range(times):
            kv.allocate(sid, toks + [7])
            kv.commit(sid, toks + [7], 5)
            kv.free(sid)
            sid += 1
    kv.allocate(sid, list(range(200, 212)))  # 3 blocks: 2 free + one eviction
    assert kv.match_prefix(kv.prompt_hashes(hot + [0]), 5).num_tokens == 4
    assert kv.match_prefix(kv.prompt_hashes(cold + [0]), 5).num_tokens == 0


def test_swap_out_moves_shared_blocks_once_and_swap_in_restores_tables():
    kv = KVCacheManager(num_blocks=16, block_size=4, num_host_blocks=16)
    kv.allocate(0, list(range(10)))
    kv.fork(0, 1)
    kv.append_slots(1)
    plan = kv.swap_out([0, 1])
    assert len(plan) == 4  # 2 shared full blocks + 2 distinct last blocks
    assert kv.num_free_blocks == 16
    back = kv.swap_in([0, 1])
    assert len(back) == 4
    assert kv.block_table(0)[:2] == kv.block_table(1)[:2]
    assert kv.num_free_blocks == 12


def test_bad_input_raises_typed_errors_and_changes_nothing():
    with pytest.raises(ConfigError):
        KVCacheManager(num_blocks=8, block_size=0)
    with pytest.raises(ConfigError):
        KVCacheManager(num_blocks=8, block_size=2049)
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.allocate(0, list(range(5)))
    with pytest.raises(OutOfBlocks, match="needs 2 KV blocks for 5 tokens"):
        kv.allocate(1, list(range(100, 105)))
    assert 1 not in kv.seqs and kv.num_free_blocks == 0
    kv.free(0)
    with pytest.raises(UnknownSequence, match="sequence 0 is not allocated"):
        kv.free(0)
    with pytest.raises(UnknownSequence):
        kv.append_slots(42)
    with pytest.raises(KVStateError):
        kv.allocate(3, [])
    assert kv.num_free_blocks == 2
