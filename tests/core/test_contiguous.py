"""Buddy allocator and contiguous reservation baselines."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.contiguous import (
    Allocation,
    BuddyAllocator,
    ContiguousKVManager,
    MaxPolicy,
    OraclePolicy,
    Pow2Policy,
    next_pow2,
)
from kvpool.errors import ConfigError, InvalidRequest, OutOfBlocks, UnknownSequence


def test_requests_round_up_to_pow2_and_internal_fragmentation_is_44_percent():
    mgr = ContiguousKVManager(4096, OraclePolicy())
    sizes = [mgr.admit(f"r{n}", n, n, n).size for n in (300, 600, 1100)]
    assert sizes == [512, 1024, 2048]
    u = mgr.usage()
    assert u.internal_frag_slots == 1584
    allocated = u.token_slots + u.reserved_slots + u.internal_frag_slots
    assert allocated == 3584
    assert round(u.internal_frag_slots / allocated, 2) == 0.44


def test_six_free_slots_split_four_plus_two_cannot_hold_six_slot_request():
    arena = BuddyAllocator(16)
    a8, a2a, a2b, a4 = arena.alloc(8), arena.alloc(2), arena.alloc(2), arena.alloc(4)
    assert (a8.offset, a2a.offset, a2b.offset, a4.offset) == (0, 8, 10, 12)
    arena.free(a2b)
    arena.free(a4)
    assert arena.free_slots == 6
    assert sorted(b.size for b in arena.free_blocks()) == [2, 4]
    with pytest.raises(OutOfBlocks, match="6 free"):
        arena.alloc(6)
    assert arena.free_slots == 6  # failed alloc changed nothing


def test_double_free_raises_typed_error():
    arena = BuddyAllocator(8)
    a = arena.alloc(3)
    arena.free(a)
    with pytest.raises(InvalidRequest):
        arena.free(a)


def test_arena_that_is_not_a_power_of_two_is_tiled_by_roots_that_never_merge():
    with pytest.raises(ConfigError, match="0"):
        BuddyAllocator(0)
    arena = BuddyAllocator(12)  # 8 + 4: the whole budget is usable
    assert arena.free_blocks() == [Allocation(0, 8), Allocation(8, 4)]
    with pytest.raises(OutOfBlocks):
        arena.alloc(12)  # rounds to 16, larger than any root
    blocks = [arena.alloc(4) for _ in range(3)]
    assert arena.free_slots == 0
    for b in blocks:
        arena.free(b)
    assert arena.free_blocks() == [Allocation(0, 8), Allocation(8, 4)]


def test_freeing_buddies_merges_back_to_one_block():
    arena = BuddyAllocator(8)
    blocks = [arena.alloc(1) for _ in range(8)]
    for b in reversed(blocks):
        arena.free(b)
    assert arena.free_blocks() == [Allocation(0, 8)]


def test_policies_reserve_max_pow2_and_exact():
    assert MaxPolicy(2048).reserve(10, 100, 50) == 2048
    assert Pow2Policy().reserve(10, 100, 50) == 74  # 10 + next_pow2(40)
    assert Pow2Policy().reserve(10, 100, 90) == 100  # capped at the request's maximum
    assert OraclePolicy().reserve(10, 100, 50) == 50


def test_usage_parts_track_generation_and_sum_to_total():
    mgr = ContiguousKVManager(1024, Pow2Policy())
    mgr.admit("a", prompt_len=10, max_len=100, final_len=40)  # reserves 10 + 32, rounded to 64
    u = mgr.usage()
    assert (u.token_slots, u.reserved_slots, u.internal_frag_slots) == (10, 30, 24)
    mgr.append("a", 5)
    u = mgr.usage()
    assert (u.token_slots, u.reserved_slots) == (15, 25)
    assert u.token_slots + u.reserved_slots + u.internal_frag_slots + u.external_frag_slots + u.free_slots == 1024
    # 1024 - 64 leaves free blocks 64 + 128 + 256 + 512: all but the largest are external.
    assert (u.external_frag_slots, u.free_slots) == (448, 512)
    assert mgr.usage(next_request_slots=200).external_frag_slots == 192


def test_append_past_final_length_and_unknown_request_are_rejected():
    mgr = ContiguousKVManager(64, OraclePolicy())
    mgr.admit("a", 4, 16, 8)
    with pytest.raises(InvalidRequest, match="final_len 8"):
        mgr.append("a", 5)
    mgr.free("a")
    with pytest.raises(UnknownSequence):
        mgr.append("a")


def test_max_policy_exhausts_arena_sooner_than_oracle():
    for policy, admitted in ((MaxPolicy(2048), 2), (OraclePolicy(), 32)):
        mgr = ContiguousKVManager(4096, policy)
        n = 0
        while mgr.can_admit(50, 200, 100):
            mgr.admit(f"r{n}", 50, 200, 100)
            n += 1
        assert n == admitted


ops = st.lists(st.tuples(st.booleans(), st.integers(1, 64), st.integers(0, 1000)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([64, 100]))
def test_buddy_invariants_hold_under_random_alloc_free(sequence, total):
    arena = BuddyAllocator(total)
    roots = arena.free_blocks()
    live: list[Allocation] = []
    for is_alloc, n, pick in sequence:
        if is_alloc or not live:
            try:
                a = arena.alloc(n)
            except OutOfBlocks:
                assert arena.largest_free_block() < next_pow2(n)
                continue
            assert a.size == next_pow2(n) and a.offset % a.size == 0
            live.append(a)
        else:
            arena.free(live.pop(pick % len(live)))
        tiles = sorted(live + arena.free_blocks(), key=lambda b: b.offset)
        pos = 0
        for b in tiles:  # free and allocated blocks tile the arena exactly
            assert b.offset == pos
            pos += b.size
        assert pos == total
        assert arena.free_slots + arena.allocated_slots == total
    for a in live:
        arena.free(a)
    assert arena.free_blocks() == roots
