"""The shadow-memory state machine both KV-manager property tests run (one group, and a full +
a sliding-window group): random interleavings of every operation.

The shadow memory plays the engine: it writes each token into the slot every group's table
names, performs the copy-on-write copies and swap plans the manager returns, and so checks that
the data movements the manager asks for are sufficient and correct. A subclass sets the pool
(`NUM_BLOCKS`, `NUM_HOST`, `GROUPS`, `PREFIXES`) and adds its own rules and invariants.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvpool.core.hashing import hash_blocks
from kvpool.core.kv_groups import NO_BLOCK, group_key
from kvpool.core.kv_manager import KVCacheManager
from kvpool.errors import OutOfBlocks

B = 4


class KVShadowMachine(RuleBasedStateMachine):
    NUM_BLOCKS = 24
    NUM_HOST = 16
    GROUPS: tuple[int | None, ...] = (None,)
    PREFIXES: list[list[int]] = [[1, 2, 3, 4, 5, 6, 7, 8, 9]]

    @initialize(policy=st.sampled_from(["lru", "lfu", "fifo"]))
    def setup(self, policy: str) -> None:
        self.kv = KVCacheManager(self.NUM_BLOCKS, B, eviction_policy=policy, num_host_blocks=self.NUM_HOST,
                                 group_windows=self.GROUPS)
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.tokens: dict[int, list[int]] = {}  # the truth per sequence
        self.truth: dict[bytes, tuple[int, ...]] = {}  # each group's key -> the tokens it names
        self.next_id = 0

    # -- the engine's part -----------------------------------------------------------------
    def _write(self, sid: int, start: int, end: int) -> None:
        toks = self.tokens[sid]
        for table in self.kv.block_tables(sid):
            for p in range(start, end):
                assert table[p // B] != NO_BLOCK, "a token is written into a freed block"
                self.dev.setdefault(table[p // B], [None] * B)[p % B] = toks[p]

    def _learn(self, toks: list[int], salt: str | None) -> None:
        for i, h in enumerate(hash_blocks(toks, B, cache_salt=salt)):
            for g in range(len(self.GROUPS)):
                self.truth[group_key(h, g)] = tuple(toks[i * B : (i + 1) * B])

    def _device_seqs(self) -> list[int]:
        return [s for s in self.tokens if not self.kv.seq(s).on_host]

    def _readable(self, n: int, group: int) -> range:
        """Positions a query at position `n` reads in `group`: all before it, or the window's W-1."""
        w = self.GROUPS[group]
        return range(n) if w is None else range(max(0, n - w + 1), n)

    # -- operations ------------------------------------------------------------------------
    @rule(data=st.data(), tail=st.lists(st.integers(0, 9), max_size=9), salt=st.sampled_from([None, None, "t1"]))
    def allocate(self, data, tail, salt):
        self.allocate_prompt(data.draw(st.sampled_from(self.PREFIXES)), tail, salt)

    def allocate_prompt(self, prefix: list[int], tail: list[int], salt: str | None) -> None:
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
        for g, table in enumerate(self.kv.block_tables(sid)):  # reused KV holds what position `cached` reads
            for p in self._readable(cached, g):
                assert self.dev[table[p // B]][p % B] == toks[p]
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

    # -- invariants every subclass checks (called from its @invariant methods) ------------------
    def check_refcounts_equal_live_table_references(self) -> None:
        dev_refs, host_refs = [0] * self.NUM_BLOCKS, [0] * self.NUM_HOST
        for sid in self.tokens:
            refs = host_refs if self.kv.seq(sid).on_host else dev_refs
            for table in self.kv.block_tables(sid):
                for b in table:
                    if b != NO_BLOCK:
                        refs[b] += 1
        assert dev_refs == [blk.ref_count for blk in self.kv.pool.blocks]
        assert host_refs == self.kv.host.ref_counts
        used = sum(1 for r in dev_refs if r)
        assert used + self.kv.num_free_blocks == self.NUM_BLOCKS == self.kv.usage().total_blocks
        assert self.kv.usage().used_blocks == used

    def check_every_cached_hash_names_a_block_holding_its_tokens(self) -> None:
        for h, b in self.kv.pool.cached_items():
            assert self.kv.pool.blocks[b].block_hash == h
            assert tuple(self.dev[b]) == self.truth[h]

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for sid in list(self.tokens):
            self.kv.free(sid)
        assert self.kv.num_free_blocks == self.NUM_BLOCKS
        assert all(blk.ref_count == 0 for blk in self.kv.pool.blocks)
        assert self.kv.host.num_free == self.NUM_HOST
        assert self.kv.usage().token_slots == 0
