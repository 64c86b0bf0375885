"""The global index keeps each instance's retention of the blocks it holds and expires it
against the conductor's `now`; routing uses it only to break ties (issue 32 item 1)."""

import math

import pytest
from conductor_helpers import BLOCK, CHAIN, make_request
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.conductor import POOL, Conductor, ConductorConfig, InstanceLoad
from kvpool.conductor.index import GlobalKVIndex
from kvpool.core.retention import Retention

PIN = Retention(math.inf, 0)


def conductor(predictor, policy, prefill=("p0", "p1"), **cfg):
    return Conductor(list(prefill), ["d0"], predictor, ConductorConfig(policy=policy, block_size=BLOCK, **cfg))


def test_the_index_keeps_retention_of_held_blocks_only_and_expires_it_by_now():
    index = GlobalKVIndex()
    index.on_stored("p0", CHAIN[:6])
    index.on_retention("p0", {h: Retention(10.0, 1) for h in CHAIN[:4]} | {CHAIN[40]: PIN})  # 40 not held
    assert index.retained_match(CHAIN[:6], now=5.0) == {"p0": 4}
    assert index.num_retained("p0", 5.0) == 4
    assert index.retained_match(CHAIN[:6], now=10.0) == {}  # until has come: no longer counted
    assert index.prefix_match(CHAIN[:6]) == {"p0": 6}  # the blocks themselves are still held


def test_an_unpin_an_eviction_or_a_down_instance_drops_the_retention():
    index = GlobalKVIndex()
    index.on_stored("p0", CHAIN[:4])
    index.on_retention("p0", dict.fromkeys(CHAIN[:4], PIN))
    index.on_retention("p0", {CHAIN[3]: None})
    assert index.retained_match(CHAIN[:4], 0.0) == {"p0": 3}
    index.on_evicted("p0", [CHAIN[1]])
    assert index.retained_match(CHAIN[:4], 0.0) == {"p0": 1}
    index.on_stored("p0", [CHAIN[1]])  # recomputed: held again, but no retention reported yet
    assert index.retained_match(CHAIN[:4], 0.0) == {"p0": 1}
    index.on_instance_down("p0")
    assert index.retained_match(CHAIN[:4], 0.0) == {} and index.num_retained("p0", 0.0) == 0


HASHES = CHAIN[:6]
EVENTS = st.lists(st.tuples(
    st.sampled_from(["stored", "evicted", "retention", "down"]), st.sampled_from(["p0", "p1"]),
    st.lists(st.sampled_from(HASHES), max_size=4), st.sampled_from([None, 5.0, 10.0, math.inf])), max_size=30)


@settings(max_examples=200, deadline=None)
@given(EVENTS, st.sampled_from([0.0, 5.0, 7.0, 20.0]))
def test_retained_match_equals_a_brute_force_replay_of_any_events(history, now):
    index = GlobalKVIndex()
    held: dict[str, set[bytes]] = {}
    until: dict[str, dict[bytes, float]] = {}
    for kind, inst, hashes, deadline in history:
        mine, kept = held.setdefault(inst, set()), until.setdefault(inst, {})
        if kind == "stored":
            index.on_stored(inst, hashes)
            mine.update(hashes)
        elif kind == "evicted":
            index.on_evicted(inst, hashes)
            mine.difference_update(hashes)
            for h in hashes:
                kept.pop(h, None)
        elif kind == "retention":
            index.on_retention(inst, dict.fromkeys(hashes, None if deadline is None else Retention(deadline, 0)))
            for h in hashes:
                if deadline is not None and h in mine:
                    kept[h] = deadline
                else:
                    kept.pop(h, None)
        else:
            index.on_instance_down(inst)
            mine.clear()
            kept.clear()
    for inst in ("p0", "p1"):
        live = [h for h, t in until.get(inst, {}).items() if t > now]
        run = next((i for i, h in enumerate(HASHES) if h not in live), len(HASHES))
        assert index.retained_match(HASHES, now).get(inst, 0) == run
        assert index.num_retained(inst, now) == len(live)


@pytest.mark.parametrize("policy", ["cache-aware", "kv-centric"])
def test_at_an_equal_prefix_routing_prefers_the_instance_that_retains_it(predictor, policy):
    c = conductor(predictor, policy)
    c.index.on_stored("p0", CHAIN[:8])
    c.index.on_stored("p1", CHAIN[:8] + CHAIN[30:60])  # fuller cache: without retention p0 wins the tie
    assert c.route(make_request("r0", blocks=8), 0.0).prefill_id == "p0"
    c.on_failed("r0")
    c.index.on_retention("p1", dict.fromkeys(CHAIN[:8], Retention(100.0, 0)))
    assert c.route(make_request("r1", blocks=8), 1.0).prefill_id == "p1"
    c.on_failed("r1")
    assert c.route(make_request("r2", blocks=8), 100.0).prefill_id == "p0"  # expired at 100 s


def test_retention_never_outweighs_a_longer_prefix_or_a_shorter_queue(predictor):
    c = conductor(predictor, "cache-aware")
    c.index.on_stored("p0", CHAIN[:10])
    c.index.on_stored("p1", CHAIN[:8])
    c.index.on_retention("p1", dict.fromkeys(CHAIN[:8], PIN))
    assert c.route(make_request("r0", blocks=10), 0.0).prefill_id == "p0"  # longer prefix
    k = conductor(predictor, "kv-centric")
    for p in ("p0", "p1"):
        k.index.on_stored(p, CHAIN[:8])
    k.index.on_retention("p1", dict.fromkeys(CHAIN[:8], PIN))
    k.update_load("p1", InstanceLoad(queued_prefill_tokens=5_000))
    assert k.route(make_request("r1", blocks=8), 0.0).prefill_id == "p0"  # smaller TTFT


def test_a_pull_source_that_retains_the_prefix_ranks_first_among_equal_holders(predictor):
    c = conductor(predictor, "kv-centric", prefill=("idle", "h0", "h1"), pull_from_peers=True)
    for h in ("h0", "h1"):
        c.index.on_stored(h, CHAIN[:20])
        c.update_load(h, InstanceLoad(queued_prefill_tokens=10_000))
    c.update_load("h0", InstanceLoad(queued_prefill_tokens=9_000))  # less queued: the source without retention
    assert c.route(make_request("r0", blocks=20), 0.0).pull_from == "h0"
    c.on_failed("r0")
    c.index.on_retention("h1", dict.fromkeys(CHAIN[:20], PIN))
    d = c.route(make_request("r1", blocks=20), 0.0)
    assert (d.prefill_id, d.pull_from, d.pull_blocks) == ("idle", "h1", 20)


def test_the_pool_stays_the_first_pull_source_and_the_snapshot_shows_retained_blocks(predictor):
    c = conductor(predictor, "kv-centric", prefill=("idle", "hot"), pull_from_peers=True)
    c.index.on_stored("hot", CHAIN[:20])
    c.index.on_stored(POOL, CHAIN[:20])
    c.index.on_retention("hot", dict.fromkeys(CHAIN[:20], PIN))
    c.update_load("hot", InstanceLoad(queued_prefill_tokens=10_000))
    assert c.route(make_request("r", blocks=20), 0.0).pull_from == POOL
    assert c.snapshot(now=0.0)["instances"]["hot"]["retained_blocks"] == 20


def test_a_pull_source_ranks_by_its_retention_only_while_it_is_live(predictor):
    c = conductor(predictor, "kv-centric", prefill=("idle", "h0", "h1"), pull_from_peers=True)
    for h, queued in (("h0", 9_000), ("h1", 10_000)):
        c.index.on_stored(h, CHAIN[:20])
        c.update_load(h, InstanceLoad(queued_prefill_tokens=queued))
    c.index.on_retention("h1", dict.fromkeys(CHAIN[:20], Retention(50.0, 0)))
    assert c.route(make_request("r0", blocks=20), 0.0).pull_from == "h1"
    c.on_failed("r0")
    assert c.route(make_request("r1", blocks=20), 50.0).pull_from == "h0"  # run out: the less queued again
