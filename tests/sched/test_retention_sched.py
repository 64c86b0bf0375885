"""Retention through the scheduler: a request's retention keeps its prompt's blocks cached
against later traffic until its TTL, which expires against the `now` the driver passes."""

from __future__ import annotations

from kvpool.core.retention import RetentionRequest
from kvpool.sched.output import Sample
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig

B = 4


def _serve(s: Scheduler, rid: str, prompt: list[int], now: float, retention=()) -> int:
    """Run one request to its end at time `now`; returns its cached prompt tokens."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, retention=retention)
    g = SequenceGroup(rid, [s.new_sequence(prompt)], params, now)
    s.add_request(g)
    while s.has_unfinished():
        out = s.schedule(now)
        s.postprocess(out, [Sample([7]) for _ in out.sampling])
    return g.num_cached_prompt_tokens


def _churn(s: Scheduler, now: float, start: int) -> None:
    for i in range(6):  # other prompts fill the 12-block cache over and over
        _serve(s, f"c{start}-{i}", [10_000 + 100 * (start + i) + j for j in range(4 * B + 1)], now)


def test_a_retained_prefix_survives_churn_until_its_ttl_then_goes():
    s = Scheduler(SchedulerConfig(num_blocks=12, block_size=B, max_num_batched_tokens=64))
    system = list(range(2 * B))  # two full blocks
    keep = (RetentionRequest(prefix_tokens=2 * B, ttl_s=60.0, priority=0),)
    _serve(s, "a", system + [99], now=0.0, retention=keep)
    _churn(s, 1.0, 0)
    assert _serve(s, "b", system + [98], now=2.0) == 2 * B  # kept
    _churn(s, 70.0, 10)  # past the TTL: the schedule at 70 s expires it, churn evicts it
    assert s.kv.pool.retention.num_ttl_expiries == 2
    assert _serve(s, "c", system + [97], now=71.0) == 0


def test_without_retention_the_same_churn_evicts_the_prefix():
    s = Scheduler(SchedulerConfig(num_blocks=12, block_size=B, max_num_batched_tokens=64))
    system = list(range(2 * B))
    _serve(s, "a", system + [99], now=0.0)
    _churn(s, 1.0, 0)
    assert _serve(s, "b", system + [98], now=2.0) == 0
    assert s.kv.pool.retention is None


def test_retention_holds_the_hashes_a_driver_supplies_as_the_simulator_does():
    """The simulator's prompts are marker tokens with hashes given on the group: retention
    must hold those hashes (the ones admission registers), not a rehash of the markers."""
    s = Scheduler(SchedulerConfig(num_blocks=12, block_size=B, max_num_batched_tokens=64))
    given = s.kv.prompt_hashes(list(range(500, 500 + 2 * B)))
    params = SamplingParams(max_tokens=1, ignore_eos=True, retention=(RetentionRequest(ttl_s=10.0),))
    g = SequenceGroup("sim", [s.new_sequence([1] * (2 * B + 1))], params, 3.0, prompt_hashes=given)
    s.add_request(g)
    assert all(s.kv.pool.retention.get(h) is not None for h in given)
    assert all(s.kv.pool.retention.get(h) is None for h in s.kv.prompt_hashes([1] * (2 * B + 1)))
