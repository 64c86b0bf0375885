"""The engine's published KV events carry retention (issue 32 item 1): a request's retention on
the blocks it stored, and a pin set between steps, each as the latest live value of a held block."""

from __future__ import annotations

import math
import time

from engine_helpers import make_engine, run_all

from kvpool.core.retention import RetentionRequest, release_prompt, retain_prompt
from kvpool.sched.sampling_params import SamplingParams

B = 4


def test_published_events_carry_a_requests_retention_then_a_pin_then_an_unpin(loaded):
    engine = make_engine(loaded, num_blocks=16, block_size=B, publish_kv_events=True)
    kv = engine.scheduler.kv
    prompt = list(range(100, 100 + 4 * B + 1))  # four full blocks
    keep = (RetentionRequest(prefix_tokens=2 * B, ttl_s=60.0, priority=5),)
    run_all(engine, [prompt], SamplingParams(max_tokens=2, temperature=0.0, retention=keep))
    first_two = kv.prompt_hashes(prompt)[:2]
    ev = engine.drain_kv_events()
    assert set(first_two) <= set(ev.stored)
    assert {h: r.priority for h, r in ev.retention.items() if h in first_two} == dict.fromkeys(first_two, 5)
    assert all(math.isfinite(r.until) for r in ev.retention.values())

    retain_prompt(kv, prompt, None, RetentionRequest(None, None, 9), time.monotonic())  # no step after it
    pinned = engine.drain_kv_events().retention
    assert set(kv.prompt_hashes(prompt)) <= set(pinned)
    assert all(r is not None and r.until == math.inf and r.priority == 9 for r in pinned.values())

    release_prompt(kv, prompt, None)
    released = engine.drain_kv_events().retention
    assert set(kv.prompt_hashes(prompt)) <= set(released) and set(released.values()) == {None}
