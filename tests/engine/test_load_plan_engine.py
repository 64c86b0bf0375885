"""Load or recompute in the engine: a store tier made slow on purpose (a delay injected into
each read) is recomputed instead of loaded, with the cold run's tokens and the miss counted as
`load_slower_than_recompute`; a fast tier is loaded; a slow tier is tried again once its estimate
is stale. Asserts decisions and tokens, never a time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpool.core.miss_reasons import LOAD_SLOWER
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import step_until_done
from kvpool.sched.sampling_params import SamplingParams

DOC = ("The museum opened in 1891 with three galleries of paintings, a hall of casts and a library. "
       "Over the next century it grew into one of the largest collections in the region. ") * 3
PROMPT = DOC + "Question: when did the museum open? Answer:"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def run(engine: Engine):
    rid = engine.add_request(PROMPT, GREEDY)
    return step_until_done(engine)[rid]


def again(engine: Engine):
    """The prompt once more, its prefix gone from the device (only the store holds it)."""
    engine.scheduler.kv.reset_prefix_cache()
    return run(engine)


@pytest.fixture(scope="module")
def reference(loaded):
    return run(Engine(EngineConfig(num_blocks=256, dtype="float32"), loaded=loaded)).outputs[0].token_ids


def test_a_slowed_disk_tier_is_recomputed_with_the_cold_tokens(loaded, reference, tmp_path: Path, monkeypatch):
    engine = Engine(EngineConfig(num_blocks=256, dtype="float32", kv_disk_path=str(tmp_path),
                                 kv_disk_size="256MiB"), loaded=loaded)
    kv_store, admission = engine.kv_store, engine.scheduler.admission
    assert admission.load_costs is kv_store
    assert run(engine).outputs[0].token_ids == reference  # cold: computes, saves, times its forwards
    kv_store.store.flush()
    fast = again(engine)  # a page-cache disk read beats recomputing a block
    held = fast.num_cached_tokens
    assert fast.outputs[0].token_ids == reference and held >= 112
    n = len(fast.prompt_token_ids)

    def delay_s() -> float:
        """Each read takes longer than the estimated recompute of the whole prompt (the estimate now:
        the box's speed, whatever its load), so no part of the hit is worth loading, whether its
        reads add to the recompute or run under it (layer-wise: the planner prices them overlapped).
        Three times, not just over: the prefill estimate moves with the box's load between this
        read and the next admission, and one block read under the forward is worth it as soon as
        it is shorter than the recompute (CI once saw 1.5x load one block)."""
        return 3.0 * kv_store.prefill_s(0, n)

    kv_store.load_timeout_s = 600.0  # no load timeout in the way
    assert kv_store.store.read_costs()["disk"].seconds(kv_store.block_bytes) < delay_s()

    disk = kv_store.store.tiers[0]
    real_get, real_range = disk.get, disk.get_range

    slept: list[float] = []

    def sleep() -> None:
        slept.append(delay_s())
        time.sleep(slept[-1])

    def slow_get(key):  # the tier slows down: each value read (whole, or layer-wise from its header)
        sleep()
        return real_get(key)

    def slow_range(key, offset, length):
        if offset == 0:
            sleep()
        return real_range(key, offset, length)

    monkeypatch.setattr(disk, "get", slow_get)
    monkeypatch.setattr(disk, "get_range", slow_range)
    learned = again(engine)  # still planned from the fast estimate: loaded slowly, the estimate moves
    assert learned.outputs[0].token_ids == reference and learned.num_cached_tokens == held
    assert kv_store.store.read_costs()["disk"].seconds(kv_store.block_bytes) > min(slept) / 2

    before = admission.num_recomputed_for_speed_tokens
    slow = again(engine)  # now recomputing is the cheaper plan
    assert slow.outputs[0].token_ids == reference
    assert slow.num_cached_tokens == 0, (kv_store.estimates(), kv_store.prefill.line(), delay_s())
    assert slow.metrics.prompt_sources.misses[LOAD_SLOWER] == held
    assert admission.num_recomputed_for_speed_tokens - before == held
    plan = kv_store.estimates()
    assert plan is not None and plan.read["disk"].seconds(plan.block_bytes) > plan.prefill_s(0, 16)

    monkeypatch.setattr(disk, "get", real_get)  # the tier recovers; a stale estimate is tried again
    monkeypatch.setattr(disk, "get_range", real_range)
    kv_store.read_estimate_max_age_s = 0.0
    back = again(engine)
    assert back.outputs[0].token_ids == reference and back.num_cached_tokens == held
    engine.close()


def test_without_planning_a_slow_tier_is_still_loaded(loaded, reference, monkeypatch):
    engine = Engine(EngineConfig(num_blocks=256, dtype="float32", kv_host_memory="64MiB", kv_load_plan=False),
                    loaded=loaded)
    assert engine.scheduler.admission.load_costs is None
    run(engine)
    engine.kv_store.store.flush()
    host = engine.kv_store.store.tiers[0]
    real_get = host.get
    monkeypatch.setattr(host, "get", lambda key: (time.sleep(0.05), real_get(key))[1])
    out = again(engine)
    out = again(engine)
    assert out.outputs[0].token_ids == reference and out.num_cached_tokens >= 112
    assert LOAD_SLOWER not in out.metrics.prompt_sources.misses
    engine.close()
