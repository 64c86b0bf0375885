"""Random interleavings of every KV-manager operation, checked against a shadow memory.

The shadow memory plays the engine: it writes each token into the slot the block table
names, performs the copy-on-write copies and swap plans the manager returns, and so
checks that the data movements the manager asks for are sufficient and correct.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.core.hashing import hash_blocks
from kvpool.core.kv_manager import KVCacheManager
from kvpool.errors import OutOfBlocks

B = 4
NUM_BLOCKS = 24
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 60], [7] * 13]


class KVManagerMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "lfu", "fifo"]))
    def setup(self, policy: str) -> None:
        self.kv = KVCacheManager(NUM_BLOCKS, B, eviction_policy=policy, num_host_blocks=16)
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.tokens: dict[int, list[int]] = {}  # the truth per sequence
        self.truth: dict[bytes, tuple[int, ...]] = {}  # hash -> the tokens it names
        self.next_id = 0

    # -- the engine's part -----------------------------------------------------------------
    def _write(self, sid: int, start: int, end: int) -> None:
        table, toks = self.kv.block_table(sid), self.tokens[sid]
        for p in range(start, end):
            self.dev.setdefault(table[p // B], [None] * B)[p % B] = toks[p]

    def _read(self, sid: int) -> list:
        table, n = self.kv.block_table(sid), len(self.tokens[sid])
        mem = self.host if self.kv.seq(sid).on_host else self.dev
        return [mem.get(table[p // B], [None] * B)[p % B] for p in range(n)]

    def _learn(self, toks: list[int], salt: str | None) -> None:
        for i, h in enumerate(hash_blocks(toks, B, cache_salt=salt)):
            self.truth[h] = tuple(toks[i * B : (i + 1) * B])

    def _device_seqs(self) -> list[int]:
        return [s for s in self.tokens if not self.kv.seq(s).on_host]

    # -- operations ------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 9), max_size=9),
          salt=st.sampled_from([None, None, "t1"]))
    def allocate(self, prefix, tail, salt):
        toks = prefix + tail
        sid, self.next_id = self.next_id, self.next_id + 1
        free_before = self.kv.num_free_blocks
        try:
            cached = self.kv.allocate(sid, toks, cache_salt=salt)
        except OutOfBlocks:
            assert sid not in self.kv.seqs and self.kv.num_free_blocks == free_before
            return
        assert cached < len(toks) and cached % B == 0
        self.tokens[sid] = toks
        assert self._read(sid)[:cached] == toks[:cached]  # reused KV holds exactly these tokens
        self._write(sid, cached, len(toks))
        self.kv.commit(sid, toks, len(toks))
        self._learn(toks, salt)

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        sid = data.draw(st.sampled_from(self._device_seqs()))
        new = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
        try:
            copies = self.kv.append_slots(sid, n)
        except OutOfBlocks:
            return
        for src, dst in copies:
            self.dev[dst] = list(self.dev[src])
        start = len(self.tokens[sid])
        self.tokens[sid] = self.tokens[sid] + new
        self._write(sid, start, start + n)
        self.kv.commit(sid, self.tokens[sid], len(self.tokens[sid]))
        self._learn(self.tokens[sid], self.kv.seq(sid).cache_salt)

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._device_seqs()))
        child, self.next_id = self.next_id, self.next_id + 1
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(sid)
        del self.tokens[sid]

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.lists(st.sampled_from(self._device_seqs()), min_size=1, max_size=3, unique=True))
        if not self.kv.can_swap_out(group):
            return
        for d, h in self.kv.swap_out(group):
            self.host[h] = list(self.dev[d])

    @precondition(lambda self: any(self.kv.seq(s).on_host for s in self.tokens))
    @rule(data=st.data())
    def swap_in(self, data):
        on_host = [s for s in self.tokens if self.kv.seq(s).on_host]
        group = data.draw(st.lists(st.sampled_from(on_host), min_size=1, max_size=3, unique=True))
        if not self.kv.can_swap_in(group):
            return
        for h, d in self.kv.swap_in(group):
            self.dev[d] = list(self.host[h])

    @rule()
    def reset_prefix_cache(self):
        self.kv.reset_prefix_cache()

    @rule(prefix=st.sampled_from(PREFIXES))
    def match_prefix(self, prefix):
        hit = self.kv.match_prefix(self.kv.prompt_hashes(prefix), len(prefix))
        for i, b in enumerate(hit.block_ids):
            assert tuple(self.dev[b]) == tuple(prefix[i * B : (i + 1) * B])

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def refcounts_equal_table_references(self):
        dev_refs, host_refs = [0] * NUM_BLOCKS, [0] * 16
        for sid in self.tokens:
            refs = host_refs if self.kv.seq(sid).on_host else dev_refs
            for b in self.kv.block_table(sid):
                refs[b] += 1
        assert dev_refs == [blk.ref_count for blk in self.kv.pool.blocks]
        assert host_refs == self.kv.host.ref_counts

    @invariant()
    def free_plus_used_is_total(self):
        used = sum(1 for blk in self.kv.pool.blocks if blk.ref_count > 0)
        assert used + self.kv.num_free_blocks == NUM_BLOCKS
        u = self.kv.usage()
        assert u.used_blocks == used

    @invariant()
    def every_cached_hash_names_a_block_holding_its_tokens(self):
        for h, b in self.kv.pool.cached_items():
            assert self.kv.pool.blocks[b].block_hash == h
            assert tuple(self.dev[b]) == self.truth[h]

    @invariant()
    def sequences_read_their_tokens_and_waste_under_a_block(self):
        token_slots = 0
        seen = set()
        for sid, toks in self.tokens.items():
            assert len(self.kv.block_table(sid)) == -(-len(toks) // B)
            assert self._read(sid) == toks
            if not self.kv.seq(sid).on_host:
                for i, b in enumerate(self.kv.block_table(sid)):
                    if b not in seen:
                        seen.add(b)
                        token_slots += min(B, len(toks) - i * B)
        assert self.kv.usage().token_slots == token_slots

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for sid in list(self.tokens):
            self.kv.free(sid)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(blk.ref_count == 0 for blk in self.kv.pool.blocks)
        assert self.kv.host.num_free == 16
        assert self.kv.usage().token_slots == 0


KVManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_kv_manager_state_machine = KVManagerMachine.TestCase
