"""Synthetic workloads: determinism, length/arrival statistics, prefixes, multi-turn."""

import numpy as np
import pytest

from kvpool.errors import ConfigError
from kvpool.sim.tokens import BlockHasher, TokenSynth
from kvpool.sim.workloads import (
    FEW_SHOT_PREFIX,
    ChatSpec,
    WorkloadSpec,
    arrival_times,
    multi_turn_workload,
    synthetic_workload,
)


def test_same_seed_gives_identical_workload_and_other_seed_differs():
    spec = WorkloadSpec(num_requests=200, rate=4.0, seed=7)
    assert synthetic_workload(spec) == synthetic_workload(spec)
    other = synthetic_workload(WorkloadSpec(num_requests=200, rate=4.0, seed=8))
    assert other != synthetic_workload(spec)


@pytest.mark.parametrize(("lengths", "inp", "out"), [("sharegpt", 161, 338), ("alpaca", 19, 58)])
def test_length_means_are_near_dataset_targets(lengths, inp, out):
    reqs = synthetic_workload(WorkloadSpec(num_requests=20000, lengths=lengths, seed=1))
    assert np.mean([r.prompt_len for r in reqs]) == pytest.approx(inp, rel=0.06)
    assert np.mean([r.output_len for r in reqs]) == pytest.approx(out, rel=0.06)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= 2048
               for r in reqs)


def test_poisson_and_bursty_arrivals_have_the_requested_rate_and_cv():
    rng = np.random.default_rng(0)
    for cv in (1.0, 3.0):
        gaps = np.diff(arrival_times(rng, 50000, rate=5.0, cv=cv))
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert not arrival_times(rng, 10, rate=float("inf")).any()
    with pytest.raises(ConfigError, match="rate=0"):
        arrival_times(rng, 10, rate=0)


def test_few_shot_prefix_is_shared_as_equal_block_hashes():
    spec = WorkloadSpec(num_requests=3, shared_prefix_len=FEW_SHOT_PREFIX[5], n=4, beam_width=2)
    reqs = synthetic_workload(spec)
    hasher = BlockHasher(16, TokenSynth())
    hashes = [hasher.hashes(r.chunks) for r in reqs]
    shared = 341 // 16
    assert hashes[0][:shared] == hashes[1][:shared] == hashes[2][:shared]
    assert all(r.prompt_len == 341 + r.chunks[1][1] and (r.n, r.beam_width) == (4, 2) for r in reqs)
    # The 22nd block mixes the prefix's last 5 tokens with private ones, so it differs.
    assert min(len(h) for h in hashes) > shared
    assert hashes[0][shared] != hashes[1][shared]


def test_multi_turn_prompt_extends_previous_prompt_and_answer():
    reqs = multi_turn_workload(ChatSpec(num_sessions=20, turns=4, seed=3))
    by_session: dict = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    synth = TokenSynth()
    checked = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.arrival_s >= prev.arrival_s
            assert nxt.chunks[: len(prev.chunks) + 1] == (*prev.chunks, (prev.output_chunk, prev.output_len))
            head = synth.tokens(prev.chunks) + synth.tokens([(prev.output_chunk, prev.output_len)])
            assert synth.tokens(nxt.chunks)[: len(head)] == head
            checked += 1
    assert checked > 10
    assert all(r.prompt_len + r.output_len <= 4096 for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
