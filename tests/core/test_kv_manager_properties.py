"""Random interleavings of every KV-manager operation on a one-group pool, checked against a
shadow memory (tests/core/kv_shadow_machine.py): the engine's writes, copies and swaps through
the tables the manager hands out read back every sequence's tokens."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from kv_shadow_machine import B, KVShadowMachine

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 60], [7] * 13]


class KVManagerMachine(KVShadowMachine):
    NUM_BLOCKS = 24
    NUM_HOST = 16
    PREFIXES = PREFIXES

    def _read(self, sid: int) -> list:
        table, n = self.kv.block_table(sid), len(self.tokens[sid])
        mem = self.host if self.kv.seq(sid).on_host else self.dev
        return [mem.get(table[p // B], [None] * B)[p % B] for p in range(n)]

    @rule(prefix=st.sampled_from(PREFIXES))
    def match_prefix(self, prefix):
        hit = self.kv.match_prefix(self.kv.prompt_hashes(prefix), len(prefix))
        for i, b in enumerate(hit.block_ids):
            assert tuple(self.dev[b]) == tuple(prefix[i * B : (i + 1) * B])

    @invariant()
    def refcounts_equal_table_references(self):
        self.check_refcounts_equal_live_table_references()

    @invariant()
    def every_cached_hash_names_a_block_holding_its_tokens(self):
        self.check_every_cached_hash_names_a_block_holding_its_tokens()

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


KVManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_kv_manager_state_machine = KVManagerMachine.TestCase
