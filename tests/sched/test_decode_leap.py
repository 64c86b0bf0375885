"""A leap over plain decode steps leaves the scheduler exactly as those steps taken one by one
(`DecodeBatch.step`) do: sequences, block tables, reference counts, cached hashes, eviction order,
free list, KV events in order, statistics."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode_batch import _samples, _state, _tokens

from kvpool.errors import KVStateError
from kvpool.sched.decode_leap import leap, leap_steps
from kvpool.sched.output import Sample
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig


def _scheduler(block_size, num_blocks, requests, caching, stop_ids=()) -> Scheduler:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=64,
                          max_model_len=96, enable_prefix_caching=caching, record_kv_events=True)
    s = Scheduler(cfg)
    for i, (prefix, length, max_tokens) in enumerate(requests):
        prompt = [prefix] * 8 + [100 + i] * length  # requests with equal `prefix` share blocks
        if s.kv.max_blocks(len(prompt), len(prompt) + max_tokens) > num_blocks:
            continue
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=list(stop_ids))
        s.add_request(SequenceGroup(f"r{i}", [s.new_sequence(prompt)], params, i))
    return s


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(24, 120),
    requests=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 40)), min_size=1, max_size=8),
    caching=st.booleans(),
    share=st.floats(0, 1),
)
def test_a_leap_equals_its_steps_taken_one_by_one(block_size, num_blocks, requests, caching, share):
    s = _scheduler(block_size, num_blocks, requests, caching)
    leapt = 0
    for _ in range(2000):
        if not s.has_unfinished():
            break
        batch = s.plain_decode()
        if batch is None:
            out = s.schedule()
            s.postprocess(out, _samples(out))
            continue
        k = round(leap_steps(batch) * share)
        twin = copy.deepcopy(s)
        twin_batch = twin.plain_decode()
        tokens: list[int] = []
        for _ in range(k):
            step_tokens = _tokens(twin_batch.seqs)
            tokens += step_tokens
            assert twin_batch.step(step_tokens) == []
        leap(batch, k, tokens)
        assert _state(s) == _state(twin)
        assert batch.steps == twin_batch.steps - k
        leapt += k
        done = batch.step(_tokens(batch.seqs))  # the batch goes on from where the leap left it
        assert [g.request_id for g in done] == [g.request_id for g in twin_batch.step(_tokens(twin_batch.seqs))]
        assert _state(s) == _state(twin)
    assert not s.has_unfinished()


def test_a_leap_never_takes_the_step_that_may_finish():
    s = _scheduler(4, 40, [(0, 5, 6), (1, 3, 9)], caching=True)
    out = s.schedule()
    s.postprocess(out, _samples(out))
    batch = s.plain_decode()
    assert batch.steps == 5 and leap_steps(batch) == 4  # r0 reaches max_tokens=6 at its 5th plain step
    with pytest.raises(KVStateError, match="cannot leap 5 steps"):
        leap(batch, 5, [7] * 10)
    with pytest.raises(KVStateError, match="takes 8 tokens"):
        leap(batch, 4, [7] * 7)


def test_no_leap_when_a_stop_token_could_end_a_sequence_early():
    s = _scheduler(4, 40, [(0, 5, 20)], caching=False, stop_ids=(3,))
    out = s.schedule()
    s.postprocess(out, _samples(out))
    batch = s.plain_decode()
    assert batch.steps > 1 and leap_steps(batch) == 0


def test_a_leap_that_fills_blocks_cached_already_equals_its_steps():
    # r1 repeats r0's prompt and tokens, so the blocks its steps fill are cached (r0's) until its
    # own new blocks evict them, some after the step that fills the block of the same key: the leap
    # must take its steps one by one (core/leap_slots.py declines).
    s = _scheduler(4, 8, [(0, 4, 14)], caching=True)
    while s.has_unfinished():
        out = s.schedule()
        s.postprocess(out, [Sample([7]) for _ in out.sampling])
    cached = len(s.kv.pool.cached_items())
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    s.add_request(SequenceGroup("r1", [s.new_sequence([0] * 8 + [100] * 4)], params, 1))
    out = s.schedule()
    s.postprocess(out, [Sample([7]) for _ in out.sampling])
    batch = s.plain_decode()
    k = leap_steps(batch)
    assert k >= 8
    twin = copy.deepcopy(s)
    twin_batch = twin.plain_decode()
    for _ in range(k):
        assert twin_batch.step([7]) == []
    leap(batch, k, [7] * k)
    assert _state(s) == _state(twin)
    assert s.kv.pool.num_evictions and len(s.kv.pool.cached_items()) < cached
