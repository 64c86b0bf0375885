"""The KV manager with two layer groups (full attention + a sliding window), checked against the
shadow memory of tests/core/kv_shadow_machine.py: random interleavings of every operation; each
group's tokens are written through its own table; a window group must keep
every block a later query reads and hold at most ceil(W/B)+1 blocks once committed."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from kv_shadow_machine import B, KVShadowMachine

from kvpool.core.hashing import hash_blocks
from kvpool.core.kv_groups import NO_BLOCK, group_key
from kvpool.core.kv_manager import KVCacheManager
from kvpool.errors import OutOfBlocks

W = 6
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 50, 60], [7] * 17]


class GroupedKVMachine(KVShadowMachine):
    NUM_BLOCKS = 40
    NUM_HOST = 24
    GROUPS = (None, W)
    PREFIXES = PREFIXES

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 9), max_size=9),
          chunk=st.integers(1, 7))
    def allocate_by_chunks(self, prefix, tail, chunk):
        """Chunked prefill: window blocks only for the chunk and the window behind it, reserved
        chunk by chunk (freed behind as each commits); all or nothing per chunk."""
        toks = prefix + tail
        sid, self.next_id = self.next_id, self.next_id + 1
        hit = self.kv.match_prefix(self.kv.prompt_hashes(toks), len(toks))
        try:
            pos = self.kv.allocate(sid, toks, hit=hit, block_hashes=self.kv.prompt_hashes(toks),
                                   upto=hit.num_tokens + chunk)
        except OutOfBlocks:
            return
        self.tokens[sid] = toks
        self._learn(toks, None)
        while pos < len(toks):
            end = min(len(toks), pos + chunk)
            free_before = self.kv.num_free_blocks
            try:
                self.kv.reserve(sid, end)
            except OutOfBlocks:
                assert self.kv.num_free_blocks == free_before  # nothing taken
                self.kv.free(sid)
                del self.tokens[sid]
                return
            self._write(sid, pos, end)
            assert self.kv.blocks_held(sid)[1] <= (W - 1 + chunk) // B + 2
            self.kv.commit(sid, toks, end)
            pos = end

    @invariant()
    def refcounts_equal_live_table_references(self):
        self.check_refcounts_equal_live_table_references()

    @invariant()
    def every_cached_hash_names_a_block_holding_its_tokens(self):
        self.check_every_cached_hash_names_a_block_holding_its_tokens()

    @invariant()
    def each_group_reads_what_its_queries_need_and_the_window_holds_little(self):
        for sid, toks in self.tokens.items():
            mem = self.host if self.kv.seq(sid).on_host else self.dev
            tables = self.kv.block_tables(sid)
            held = self.kv.blocks_held(sid)
            for g, table in enumerate(tables):
                assert len(table) == -(-len(toks) // B)
                for p in self._readable(len(toks), g):
                    assert mem[table[p // B]][p % B] == toks[p]
            assert held[0] == len(tables[0])
            assert held[1] <= -(-W // B) + 1  # every sequence here is committed up to its end


GroupedKVMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
test_grouped_kv_manager_state_machine = GroupedKVMachine.TestCase


def test_freed_window_blocks_serve_another_request():
    """A long sequence of a windowed model keeps ceil(W/B)+1 window blocks; the blocks it freed
    go to the next request, which fits only because of them."""
    kv = KVCacheManager(3 * 8 + 2, 4, group_windows=(None, 6), enable_prefix_caching=False)
    toks = list(range(30))  # 8 blocks per group
    kv.allocate(0, toks)
    kv.commit(0, toks, 30)
    assert kv.blocks_held(0) == [8, 2]  # position 30 reads 25..30: blocks 6, 7 of the window
    freed = set(range(26)) - {b for t in kv.block_tables(0) for b in t if b != NO_BLOCK}
    assert kv.num_free_blocks == 26 - 10
    kv.allocate(1, list(range(28)))  # 7 + 7 blocks: more than were free before the freeing
    assert freed & {b for t in kv.block_tables(1) for b in t}


def test_window_prefix_hit_needs_the_blocks_before_the_hit_point():
    """A cached prefix is usable only up to where the window group still holds the
    ceil((W-1)/B) blocks before the hit point; freed window blocks stay cached until evicted."""
    kv = KVCacheManager(64, 4, group_windows=(None, 6))
    toks = list(range(24))
    kv.allocate(0, toks)
    kv.commit(0, toks, 24)  # window blocks 0..3 are freed at once, but cached (registered first)
    assert kv.blocks_held(0) == [6, 2]
    kv.free(0)
    assert kv.match_prefix(kv.prompt_hashes(toks[:16] + [99] * 8), 24).num_tokens == 16
    kv.allocate(1, [1000 + i for i in range(112)])  # 56 blocks: evicts the 4 oldest cached (window 0..3)
    assert kv.match_prefix(kv.prompt_hashes(toks[:16] + [99] * 8), 24).num_tokens == 0
    longer = toks + [5] * 16
    hit = kv.match_prefix(kv.prompt_hashes(longer), len(longer))
    assert hit.num_tokens == 24  # window blocks 4, 5 cover a hit of 6 blocks
    assert hit.tables[1][:4] == (NO_BLOCK,) * 4
    kv.free(1)
    cached = kv.allocate(2, longer)
    assert cached == 24 and kv.blocks_held(2) == [10, 10 - 4]


def test_each_group_registers_under_its_own_key_and_events_name_both():
    """Store keys and the conductor's events derive from the registered hash: group 1's blocks
    carry the group in it, so the same tokens in two groups are two entries, never one."""
    kv = KVCacheManager(32, 4, group_windows=(None, 6), record_events=True)
    toks = list(range(9))
    kv.allocate(0, toks)
    kv.commit(0, toks, 9)
    hashes = kv.prompt_hashes(toks)
    tagged = [group_key(h, 1) for h in hashes]
    assert kv.drain_events().stored == [*hashes, *tagged]
    tables = kv.block_tables(0)
    assert [kv.pool.lookup(h) for h in hashes] == tables[0][:2]
    assert tables[1][0] == NO_BLOCK and kv.pool.lookup(tagged[1]) == tables[1][1]
    freed = kv.pool.lookup(tagged[0])  # left the window (position 9 reads 4..9): freed, still cached
    assert freed is not None and kv.pool.blocks[freed].ref_count == 0


def test_one_groups_allocation_never_evicts_another_groups_hit_block():
    """Found by the state machine above: the window group's hit block was idle in the cache and
    the full group's new blocks, allocated first, evicted it, so both groups' tables named one
    block. Every group's hit is referenced before any group allocates."""
    m = GroupedKVMachine()
    m.setup(policy="lru")
    first, other = PREFIXES[0], PREFIXES[1]
    m.allocate_prompt(first, [], None)
    m.kv.free(0)
    del m.tokens[0]
    for prefix, tail in ((other, [0] * 7), (first, [0] * 8), (first, [0, 0, 1, 0, 0, 0, 0, 0]),
                         (PREFIXES[2], [0] * 4), (first, [0, 0, 2, 0]), (other, [])):
        m.allocate_prompt(prefix, tail, None)
        m.refcounts_equal_live_table_references()
        m.each_group_reads_what_its_queries_need_and_the_window_holds_little()
    last = m.kv.block_tables(m.next_id - 1)
    assert not set(last[0]) & set(last[1])
    m.teardown()


def test_interned_int_keys_serve_as_digests_in_every_group():
    """A driver may name prompt blocks by interned ints (the simulator, sim/tokens.py): each group
    registers them under its own key, a prompt with the same keys hits them, and the blocks filled
    after them chain on from the int as from a digest."""
    kv = KVCacheManager(32, 4, group_windows=(None, 6), record_events=True)
    toks = list(range(10))
    kv.allocate(0, toks, block_hashes=[101, 102])
    kv.append_slots(0, 2)
    kv.commit(0, toks + [10, 11], 12)
    third = hash_blocks(list(range(12)), 4, parent=(102).to_bytes(16, "little"), start_block=2)
    assert kv.seq(0).hashes == [101, 102, *third]
    stored = kv.drain_events().stored
    assert stored == [101, 102, third[0], *(group_key(h, 1) for h in (101, 102, third[0]))]
    assert len(set(stored)) == 6
    kv.free(0)
    assert kv.allocate(1, list(range(12)), block_hashes=[101, 102]) == 8
