"""Plain decode steps taken by `DecodeBatch.step()` leave the scheduler exactly as
`schedule()` + `postprocess()` do: a twin scheduler takes every step the long way and the two
states (sequences, block tables, reference counts, cached hashes, eviction order, free list,
KV events, statistics) are compared after each step."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.sched.output import Sample
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig


def _state(s: Scheduler) -> tuple:
    kv, pool = s.kv, s.kv.pool
    seqs = [
        (g.request_id, q.seq_id, list(q.token_ids), q.num_computed_tokens, q.status, g.first_scheduled)
        for g in [*s.running, *s.waiting, *s.swapped]
        for q in g.seqs
    ]
    tables = {sid: (e.num_tokens, list(e.hashes), e.num_registered, [list(t) for t in e.tables],
                    list(e.dead)) for sid, e in kv.seqs.items()}
    events = (list(pool.events.stored), list(pool.events.evicted), list(pool.events.evicted_block_ids))
    return (
        seqs, tables, list(pool.ref_counts), list(pool.block_tokens), list(pool.block_hashes),
        pool.cached_items(), list(pool._free), pool._evictable.order(), pool.tokens_in_use,
        pool.num_evictions, events, kv.stats, s.num_preemptions,
    )


def _token(seq_id: int, n: int) -> int:
    return 1000 + (seq_id * 7919 + n * 104729) % 5000


def _tokens(pairs) -> list[int]:
    return [_token(q.seq_id, len(q.token_ids)) for _, q in pairs]


def _samples(out) -> list[Sample]:
    return [Sample(_tokens([(x.group, x.seq)])) for x in out.sampling]


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(24, 120),
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 40)), min_size=1, max_size=8
    ),
    caching=st.booleans(),
)
def test_plain_decode_steps_equal_the_full_schedule(block_size, num_blocks, requests, caching):
    _check_plain_equals_full(block_size, num_blocks, requests, caching, (None,))


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(24, 160),
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 40)), min_size=1, max_size=8
    ),
    caching=st.booleans(),
    windows=st.sampled_from([(None, 6), (5,), (None, 3, 3)]),
)
def test_plain_decode_steps_equal_the_full_schedule_with_window_groups(block_size, num_blocks, requests, caching,
                                                                       windows):
    """Window groups free blocks at other steps than a block filling: the shortcut still commits
    (and frees) exactly as the full schedule does."""
    _check_plain_equals_full(block_size, num_blocks, requests, caching, windows)


def _check_plain_equals_full(block_size, num_blocks, requests, caching, windows):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=64,
                          max_model_len=96, enable_prefix_caching=caching, record_kv_events=True,
                          kv_group_windows=windows)
    s = Scheduler(cfg)
    for i, (prefix, length, max_tokens) in enumerate(requests):
        prompt = [prefix] * 8 + [100 + i] * length  # requests with equal `prefix` share blocks
        if s.kv.max_blocks(len(prompt), len(prompt) + max_tokens) > num_blocks:
            continue  # could never fit
        group = SequenceGroup(f"r{i}", [s.new_sequence(prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True), i)
        s.add_request(group)
    plain_steps = 0
    for _ in range(2000):
        if not s.has_unfinished():
            break
        batch = s.plain_decode()
        if batch is None:
            out = s.schedule()
            s.postprocess(out, _samples(out))
            continue
        twin = copy.deepcopy(s)
        for _ in range(batch.steps):
            out = twin.schedule()
            assert [(x.group.request_id, x.seq.seq_id, x.num_new_tokens) for x in out.scheduled] == [
                (g.request_id, q.seq_id, 1) for g, q in batch.seqs
            ]
            assert not (out.copies or out.swap_in or out.swap_out or out.preempted)
            done = batch.step(_tokens(batch.seqs))
            twin_done = twin.postprocess(out, _samples(out))
            assert [g.request_id for g in done] == [g.request_id for g in twin_done]
            assert _state(s) == _state(twin)
            plain_steps += 1
            if done:
                break
    assert not s.has_unfinished()


def test_a_batch_needing_more_blocks_than_free_stops_before_it_would_preempt():
    cfg = SchedulerConfig(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    s = Scheduler(cfg)
    for i in range(2):
        group = SequenceGroup(f"r{i}", [s.new_sequence([i + 1] * 4)], SamplingParams(max_tokens=16, ignore_eos=True), i)
        s.add_request(group)
    out = s.schedule()
    s.postprocess(out, _samples(out))
    batch = s.plain_decode()  # 2 full blocks held, 4 free: both take a new block now and 4 steps on
    assert batch is not None and batch.steps == 8  # the 9th step would need 2 more than are free
