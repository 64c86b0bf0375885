"""The rewind op (core/rewind.py, `Scheduler.rewind`): a sequence's KV from a token on turns out bad
during the forward that read it; its blocks from there leave the prefix cache (kept, not freed),
its row of that step is neither committed nor sampled, and it recomputes from there."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvpool.core.hashing import BlockHash
from kvpool.core.kv_manager import KVCacheManager
from kvpool.core.miss_reasons import INTEGRITY, PARTIAL_BLOCK, MissLedger
from kvpool.core.rewind import rewind
from kvpool.errors import KVStateError, UnknownSequence
from kvpool.sched.output import Sample
from kvpool.sched.request import SeqStatus, SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig

B = 4


def committed(kv: KVCacheManager, seq_id: int, n: int) -> list[int]:
    tokens = list(range(1, n + 1))
    kv.allocate(seq_id, tokens)
    kv.commit(seq_id, tokens, n)
    return tokens


def test_rewind_unregisters_the_blocks_from_the_point_on_and_keeps_them():
    kv = KVCacheManager(16, B)
    tokens = committed(kv, 1, 17)  # 4 full blocks registered, a fifth holding one token
    hashes = kv.prompt_hashes(tokens)
    table, free = list(kv.block_table(1)), kv.num_free_blocks
    assert rewind(kv, 1, 6) == 3  # token 6 is in block 1: blocks 1..3 held a hash
    assert [kv.pool.lookup(h) for h in hashes] == [table[0], None, None, None]
    assert kv.block_table(1) == table and kv.num_free_blocks == free  # nothing freed, nothing taken
    assert kv.seq(1).num_registered == 1
    kv.commit(1, tokens, 17)  # recomputed: registered again, in the same blocks
    assert [kv.pool.lookup(h) for h in hashes] == table[:4]
    kv.free(1)
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_a_bad_rewind_raises_and_changes_nothing():
    kv = KVCacheManager(16, B)
    tokens = committed(kv, 1, 12)
    before = [kv.pool.lookup(h) for h in kv.prompt_hashes(tokens)]
    for bad in (-1, 13):
        with pytest.raises(KVStateError):
            rewind(kv, 1, bad)
    with pytest.raises(UnknownSequence):
        rewind(kv, 2, 0)
    assert [kv.pool.lookup(h) for h in kv.prompt_hashes(tokens)] == before
    assert kv.seq(1).num_registered == 3


def test_a_window_group_must_still_hold_what_a_query_at_the_point_reads():
    kv = KVCacheManager(32, B, group_windows=(None, 8))
    tokens = committed(kv, 1, 28)  # the window group freed the blocks wholly before token 21
    assert kv.seq(1).dead[1] == 5
    with pytest.raises(KVStateError):
        rewind(kv, 1, 24)  # a query at 24 reads tokens 17..24: block 4, given back
    assert kv.seq(1).num_registered == 7
    assert rewind(kv, 1, 27) == 2  # reads 20..27 (blocks 5, 6): block 6 leaves both groups' cache
    kv.commit(1, tokens, 28)
    kv.free(1)
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_a_swapped_out_sequence_rewinds_what_its_swap_in_registers():
    kv = KVCacheManager(16, B, num_host_blocks=8)
    tokens = committed(kv, 1, 12)
    hashes = kv.prompt_hashes(tokens)
    kv.swap_out([1])  # its device blocks stay cached under their hashes
    assert rewind(kv, 1, 4) == 2  # blocks 1 and 2: out of the device cache too
    assert kv.pool.lookup(hashes[0]) is not None and kv.pool.lookup(hashes[1]) is None
    assert kv.pool.num_cached_evictable == 1
    kv.swap_in([1])
    assert [kv.pool.lookup(h) is not None for h in hashes] == [True, False, False]
    kv.free(1)
    assert kv.num_free_blocks == kv.pool.num_blocks


class Store:
    """Every block of a prompt is in a (stand-in) store tier."""

    def __init__(self) -> None:
        self.held: set[BlockHash] = set()

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return n


def test_a_rewound_row_is_neither_committed_nor_sampled_and_recomputes():
    store = Store()
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=B, max_num_batched_tokens=64), external_kv=store.lookup)
    kv = s.kv
    kv.ledger = MissLedger(B, kv.namespace, kv.pool.lookup, False, ("disk",), lambda keys: ["disk"] * len(keys))
    prompt = list(range(1, 18))  # 4 full blocks a hit can reach, then the last token
    store.held.update(kv.prompt_hashes(prompt))
    group = SequenceGroup("r", [s.new_sequence(prompt)], SamplingParams(max_tokens=2, temperature=0.0,
                                                                          ignore_eos=True), 0.0)
    s.add_request(group)
    seq = group.seqs[0]
    out = s.schedule()
    assert len(out.kv_loads) == 1 and out.is_empty
    s.finish_kv_load(out.kv_loads[0], 4)  # every header checked: the hit is 16 tokens
    s.postprocess(out, [])
    out = s.schedule()
    assert [(r.start, r.num_new_tokens) for r in out.scheduled] == [(16, 1)]
    s.rewind(group, seq, 8, out)  # block 2 failed its layer check under this forward
    assert out.scheduled[0].rewound
    s.postprocess(out, [Sample([99])])  # a driver that sampled anyway: the token is dropped
    assert seq.output_ids == [] and seq.num_computed_tokens == 8
    assert all(kv.pool.lookup(h) is None for h in kv.prompt_hashes(prompt))  # loaded blocks register on commit
    out = s.schedule()
    assert [(r.start, r.num_new_tokens, r.samples) for r in out.scheduled] == [(8, 9, True)]
    s.postprocess(out, [Sample([7])])
    while s.has_unfinished():
        out = s.schedule()
        s.postprocess(out, [Sample([8]) for _ in out.sampling])
    assert seq.output_ids == [7, 8] and seq.status is SeqStatus.FINISHED
    assert group.num_cached_prompt_tokens == 8
    assert group.prompt_sources.sources == {"disk": 8}
    assert group.prompt_sources.misses == {INTEGRITY: 8, PARTIAL_BLOCK: 1}
    assert s.num_external_hit_tokens == 8
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_a_rewind_past_the_computed_tokens_is_refused():
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=B, max_num_batched_tokens=64))
    group = SequenceGroup("r", [s.new_sequence(list(range(1, 10)))], SamplingParams(max_tokens=1), 0.0)
    s.add_request(group)
    out = s.schedule()
    with pytest.raises(KVStateError):
        s.rewind(group, group.seqs[0], 4, out)  # nothing is computed yet
    assert not out.scheduled[0].rewound
