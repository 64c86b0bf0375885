"""#32 item 1 through `kvpool conductor`: a request's retention (kvpool_retention, chat's
cache_control) is relayed to the instance as kvpool_retention and holds there (one colocated
instance of 32 blocks behind the gateway, so a few prompts evict everything unretained)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from cluster_helpers import running_cluster

from kvpool.cluster.local import ClusterSpec, LocalCluster

INSTANCE_ARGS = ["--dtype", "float32", "--num-blocks", "32", "--max-model-len", "512", "--threads", "1"]
PROMPT = "The ledger of ships that entered the harbour this season, carefully kept by the clerk. " * 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(colocated=1, pool="none", instance_args=INSTANCE_ARGS,
                       log_dir=str(tmp_path_factory.mktemp("retention-cluster")))
    yield from running_cluster(spec)


def _cached(cluster: LocalCluster, prompt: str, **extra) -> int:
    r = httpx.post(f"{cluster.conductor_url}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_conductor_relays_retention_to_the_instance(cluster):
    other = "An unretained note about lighthouses and their keepers, written once. " * 3
    _cached(cluster, other)
    _cached(cluster, PROMPT, kvpool_retention={"ttl": "1h"})
    for i in range(7):
        _cached(cluster, f"churn {i}: " + f"rivers, bridges and the number {i} counted slowly. " * 9)
    assert _cached(cluster, PROMPT) >= 48
    assert _cached(cluster, other) == 0


def test_the_conductor_refuses_a_malformed_retention_by_name(cluster):
    r = httpx.post(f"{cluster.conductor_url}/v1/completions", timeout=60,
                   json={"prompt": "hi", "max_tokens": 1, "kvpool_retention": {"ttl": "2h"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kvpool_retention.ttl"


def _retained_blocks(cluster: LocalCluster) -> int:
    snap = httpx.get(f"{cluster.conductor_url}/cluster", timeout=10).json()
    return sum(i.get("retained_blocks", 0) for i in snap["instances"].values())


def test_the_conductors_index_learns_the_instances_retention_from_its_events(cluster):
    pinned = "A pinned preamble that the cluster should remember for a long while, line by line. " * 3
    before = _retained_blocks(cluster)
    _cached(cluster, pinned, kvpool_retention={"ttl": "1h", "priority": 3})
    retained, deadline = before, time.monotonic() + 30
    while retained < before + 3 and time.monotonic() < deadline:  # a later poll of /internal/state carries it
        time.sleep(0.2)
        retained = _retained_blocks(cluster)
    assert retained >= before + 3  # the prompt's full blocks (16 tokens each), live on the conductor's clock
