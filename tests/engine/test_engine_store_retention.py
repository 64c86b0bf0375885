"""Retention reaches the store (issue 32, item 1): a prompt pinned on the engine survives churn
through a small host tier and is served from it after the device cache lost it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import step_until_done
from kvpool.sched.sampling_params import SamplingParams

DOC = ("The museum opened in 1891 with three galleries of paintings, a hall of casts and a library. "
       "Over the next century it grew into one of the largest collections in the region. ") * 3
PROMPT = DOC + "Question: when did the museum open? Answer:"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def run(engine: Engine, prompt: str, params: SamplingParams = GREEDY):
    rid = engine.add_request(prompt, params)
    out = step_until_done(engine)[rid]
    engine.kv_store.store.flush()
    return out


def host_loaded_tokens(engine: Engine, prompt: str) -> int:
    engine.scheduler.kv.reset_prefix_cache()
    before = engine.scheduler.num_external_hit_tokens
    run(engine, prompt)
    return engine.scheduler.num_external_hit_tokens - before


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_prompt_outlives_churn_in_a_small_host_tier(loaded, pinned):
    probe = Engine(EngineConfig(num_blocks=256, dtype="float32", kv_host_memory="64MiB"), loaded=loaded)
    run(probe, PROMPT)
    host = probe.kv_store.store.tiers[0].stats()
    blocks, block_bytes = host.puts, host.used_bytes // host.puts
    probe.close()

    engine = Engine(EngineConfig(num_blocks=256, dtype="float32", kv_host_memory=str((blocks + 2) * block_bytes)),
                    loaded=loaded)
    params = replace(GREEDY, retention={"ttl_s": None}) if pinned else GREEDY
    run(engine, PROMPT, params)
    for i in range(3):  # each as long as the prompt: together far more than the tier holds
        run(engine, f"Visitor log {i}. " + DOC)
    stats = engine.kv_store.store.tiers[0].stats()
    assert stats.evictions >= 2 * blocks and stats.pinned_evictions == 0
    hit = host_loaded_tokens(engine, PROMPT)
    assert (hit >= 16 * (blocks - 1)) if pinned else hit == 0
    engine.close()
