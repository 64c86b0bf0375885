"""Prefill routing policies on hand-built cluster states."""

import json
from dataclasses import replace

import pytest
from conductor_helpers import BLOCK, CHAIN, make_request

from kvpool.conductor import (
    POOL,
    Conductor,
    ConductorConfig,
    InstanceLoad,
    RouteRequest,
    TransferCost,
)
from kvpool.errors import ConfigError, InvalidRequest


def conductor(predictor, policy, prefill=("p0", "p1", "p2"), decode=("d0",), **cfg):
    return Conductor(
        list(prefill), list(decode), predictor, ConductorConfig(policy=policy, block_size=BLOCK, **cfg)
    )


def test_cache_aware_picks_the_longest_prefix(predictor):
    c = conductor(predictor, "cache-aware")
    c.index.on_stored("p0", CHAIN[:5])
    c.index.on_stored("p1", CHAIN[:12])
    c.index.on_stored("p2", CHAIN[:3])
    c.update_load("p1", InstanceLoad(queued_prefill_tokens=50_000))  # busy, still chosen
    d = c.route(make_request("r"), now=0.0)
    assert (d.accepted, d.prefill_id, d.cached_blocks, d.pull_from) == (True, "p1", 12, None)


def test_cache_aware_breaks_prefix_ties_by_least_load(predictor):
    c = conductor(predictor, "cache-aware")
    for p in ("p0", "p1", "p2"):
        c.index.on_stored(p, CHAIN[:4])
    c.update_load("p0", InstanceLoad(queued_prefill_tokens=300))
    c.update_load("p1", InstanceLoad(queued_prefill_tokens=100))
    c.update_load("p2", InstanceLoad(queued_prefill_tokens=200))
    assert c.route(make_request("r"), 0.0).prefill_id == "p1"


@pytest.mark.parametrize("policy", ["cache-aware", "kv-centric"])
def test_a_new_prefix_goes_to_the_emptiest_idle_cache(predictor, policy):
    """Idle instances tie on prefix and load: new documents spread by cache occupancy instead
    of all landing on the first instance (which would thrash its cache)."""
    c = conductor(predictor, policy)
    other_doc = [bytes([200, i]) for i in range(30)]
    c.index.on_stored("p0", other_doc[:30])
    c.index.on_stored("p1", other_doc[:10])
    c.index.on_stored("p2", other_doc[:20])
    assert c.route(make_request("r"), 0.0).prefill_id == "p1"


def test_kv_centric_avoids_a_hot_instance_and_pulls_its_prefix(predictor):
    c = conductor(predictor, "kv-centric", prefill=("hot", "idle"), pull_from_peers=True)
    c.index.on_stored("hot", CHAIN[:20])
    c.index.on_stored("idle", CHAIN[:2])
    c.update_load("hot", InstanceLoad(queued_prefill_tokens=10_000))  # ~10 s of queue
    d = c.route(make_request("r", blocks=20), now=0.0)
    assert d.prefill_id == "idle"
    assert (d.pull_from, d.pull_blocks, d.cached_blocks) == ("hot", 18, 20)
    # transfer 1 ms + 18 x 1 ms, then the 1 uncached token at 1 ms
    assert d.predicted_ttft == pytest.approx(0.019 + 0.001)
    assert c.stats.pulls == 1 and c.stats.pulled_blocks == 18


def test_kv_centric_pulls_only_from_the_pool_unless_peers_can_serve_pulls(predictor):
    """The real cluster moves KV only through the pool: without one, a pull from a peer
    would be a full recompute, so the hot holder's prefix is not offered as a source."""
    c = conductor(predictor, "kv-centric", prefill=("hot", "idle"))
    c.index.on_stored("hot", CHAIN[:20])
    c.update_load("hot", InstanceLoad(queued_prefill_tokens=10_000))
    d = c.route(make_request("r", blocks=20), now=0.0)
    assert (d.prefill_id, d.pull_from, d.cached_blocks) == ("idle", None, 0)
    c.index.on_stored(POOL, CHAIN[:20])
    d = c.route(make_request("r2", blocks=20), now=0.0)
    assert (d.prefill_id, d.pull_from, d.cached_blocks) == ("idle", POOL, 20)


def test_kv_centric_prefers_the_pool_as_pull_source(predictor):
    c = conductor(predictor, "kv-centric", prefill=("hot", "idle"))
    c.index.on_stored("hot", CHAIN[:20])
    c.index.on_stored(POOL, CHAIN[:20])
    c.update_load("hot", InstanceLoad(queued_prefill_tokens=10_000))
    d = c.route(make_request("r", blocks=20), now=0.0)
    assert (d.prefill_id, d.pull_from) == ("idle", POOL)


def test_kv_centric_does_not_pull_below_the_replication_threshold(predictor):
    c = conductor(predictor, "kv-centric", prefill=("hot", "warm"), replication_threshold=2.0)
    c.index.on_stored("hot", CHAIN[:20])
    c.index.on_stored("warm", CHAIN[:12])  # 20 / 12 < 2
    c.update_load("hot", InstanceLoad(queued_prefill_tokens=10_000))
    d = c.route(make_request("r", blocks=20), now=0.0)
    assert (d.prefill_id, d.pull_from, d.pull_blocks, d.cached_blocks) == ("warm", None, 0, 12)


def test_kv_centric_computes_locally_when_pulling_is_slower(predictor):
    slow_link = replace(predictor, transfer=TransferCost(1e6, latency_s=1.0, block_bytes=10**6))
    c = conductor(slow_link, "kv-centric", prefill=("hot", "idle"))
    c.index.on_stored("hot", CHAIN[:20])
    c.update_load("hot", InstanceLoad(queued_prefill_tokens=10_000))
    d = c.route(make_request("r", blocks=20), now=0.0)
    assert (d.prefill_id, d.pull_from, d.cached_blocks) == ("idle", None, 0)
    assert d.predicted_ttft == pytest.approx(0.321)


def test_kv_centric_stays_on_the_holder_when_it_is_not_busy(predictor):
    c = conductor(predictor, "kv-centric", prefill=("a", "b"))
    c.index.on_stored("b", CHAIN[:20])
    d = c.route(make_request("r", blocks=20), now=0.0)
    assert (d.prefill_id, d.pull_from) == ("b", None)


def test_full_prompt_hit_still_recomputes_the_last_token(predictor):
    c = conductor(predictor, "kv-centric", prefill=("a",))
    c.index.on_stored("a", CHAIN[:4])
    d = c.route(make_request("r", blocks=4, extra=0), now=0.0)
    assert d.cached_blocks == 3


def test_least_load_breaks_queue_ties_by_requests_running(predictor):
    c = conductor(predictor, "least-load", decode=())
    c.update_load("p0", InstanceLoad(running_decode_reqs=3))
    c.update_load("p1", InstanceLoad(running_decode_reqs=1))
    c.update_load("p2", InstanceLoad(running_decode_reqs=2))
    assert c.route(make_request("r"), 0.0).prefill_id == "p1"


def test_round_robin_cycles_and_skips_down_instances(predictor):
    c = conductor(predictor, "round-robin")
    picks = [c.route(make_request(f"a{i}"), 0.0).prefill_id for i in range(4)]
    assert picks == ["p0", "p1", "p2", "p0"]
    c.mark_down("p1")
    picks = [c.route(make_request(f"b{i}"), 0.0).prefill_id for i in range(3)]
    assert picks == ["p2", "p0", "p2"]


def test_least_load_picks_the_smallest_queue(predictor):
    c = conductor(predictor, "least-load")
    c.update_load("p0", InstanceLoad(queued_prefill_tokens=500))
    c.update_load("p1", InstanceLoad(queued_prefill_tokens=50))
    c.update_load("p2", InstanceLoad(queued_prefill_tokens=200))
    assert c.route(make_request("r"), 0.0).prefill_id == "p1"


def test_a_burst_between_load_reports_spreads_over_instances(predictor):
    c = conductor(predictor, "least-load")
    picks = {c.route(make_request(f"r{i}"), 0.0).prefill_id for i in range(3)}
    assert picks == {"p0", "p1", "p2"}
    assert [c.queued_prefill_tokens(p) for p in ("p0", "p1", "p2")] == [321] * 3


def test_prefill_done_and_reports_keep_the_queue_estimate_exact(predictor):
    c = conductor(predictor, "least-load", prefill=("p0",))
    c.route(make_request("a"), 0.0)
    c.route(make_request("b"), 0.0)
    assert c.queued_prefill_tokens("p0") == 642
    c.update_load("p0", InstanceLoad(queued_prefill_tokens=642))  # report includes a and b
    c.route(make_request("c"), 0.0)
    assert c.queued_prefill_tokens("p0") == 963
    c.on_prefill_done("a", 1.0)  # counted in the report
    c.on_prefill_done("c", 1.0)  # routed after it
    assert c.queued_prefill_tokens("p0") == 321


def test_mark_down_routes_elsewhere_and_forgets_its_blocks(predictor):
    c = conductor(predictor, "cache-aware", prefill=("p0", "p1"))
    c.index.on_stored("p0", CHAIN[:20])
    assert c.route(make_request("a"), 0.0).prefill_id == "p0"
    c.mark_down("p0")
    assert c.index.num_blocks("p0") == 0
    d = c.route(make_request("b"), 0.0)
    assert (d.prefill_id, d.cached_blocks) == ("p1", 0)
    c.mark_up("p0")
    assert c.route(make_request("c"), 0.0).prefill_id == "p0"  # empty cache, no queue


def test_all_prefill_instances_down_rejects(predictor):
    c = conductor(predictor, "kv-centric", prefill=("p0",))
    c.mark_down("p0")
    d = c.route(make_request("r"), 0.0)
    assert (d.accepted, d.reason) == (False, "no_prefill_instance")


def test_random_policy_is_deterministic_for_a_seed(predictor):
    def picks(seed):
        c = conductor(predictor, "random", prefill=[f"p{i}" for i in range(8)], seed=seed)
        return [c.route(make_request(f"r{i}"), 0.0).prefill_id for i in range(40)]

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)
    assert len(set(picks(7))) > 1


def test_route_validates_the_request(predictor):
    c = conductor(predictor, "kv-centric")
    with pytest.raises(InvalidRequest, match="block hashes"):
        c.route(RouteRequest("r", 20, CHAIN[:3], 5), 0.0)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        c.route(RouteRequest("r", 20, (), 0), 0.0)
    c.route(make_request("dup"), 0.0)
    with pytest.raises(InvalidRequest, match="already routed"):
        c.route(make_request("dup"), 0.0)


def test_config_and_unknown_instances_are_rejected(predictor):
    with pytest.raises(ConfigError, match="policy"):
        ConductorConfig(policy="fastest")
    with pytest.raises(ConfigError, match="replication_threshold"):
        ConductorConfig(replication_threshold=0.5)
    c = conductor(predictor, "kv-centric")
    with pytest.raises(ConfigError, match="unknown instance 'zz'"):
        c.update_load("zz", InstanceLoad())


def test_snapshot_is_json_ready(predictor):
    c = conductor(predictor, "kv-centric")
    c.index.on_stored(POOL, CHAIN[:2])
    c.route(make_request("r"), 0.0)
    snap = json.loads(json.dumps(c.snapshot(now=0.0)))
    assert snap["stats"]["accepted"] == 1
    assert snap["pool_blocks"] == 2
    assert snap["instances"]["d0"]["role"] == "decode"
    assert snap["instances"]["d0"]["decode_load"] == 1
