"""#32 item 1, cluster part: `POST /v1/kv/pin` / `/v1/kv/unpin` on `kvpool conductor` reach every
instance (two colocated instances of 32 blocks, so a few prompts evict everything unretained),
scoped per tenant like the instances' own routes; a down or hung instance gives a partial answer
and is sent the pin when it is back; `kvpool_conductor:retained_blocks` reads the retention.

The instances have their own API key, so the conductor reaches their pin routes with the cluster
key; this test calls them directly with `cache_scope: "shared"` to name a namespace exactly."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from cluster_helpers import running_cluster

from kvpool.cluster.local import ClusterSpec, LocalCluster
from kvpool.serve.auth import KeyRing

K1, K2, ADMIN, INSTANCE_KEY = "pins-tenant-one", "pins-tenant-two", "pins-admin", "pins-instance-key"
INSTANCE_ARGS = ["--dtype", "float32", "--num-blocks", "32", "--max-model-len", "512", "--threads", "1",
                 "--api-key", INSTANCE_KEY]
PROMPT = "The ledger of ships that entered the harbour this season, carefully kept by the clerk. " * 3
OTHER = "An unretained note about lighthouses and their keepers, written once. " * 3


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(colocated=2, pool="none", instance_args=INSTANCE_ARGS, api_key=K1,
                       conductor_args=["--api-key", K2, "--admin-api-key", ADMIN],
                       log_dir=str(tmp_path_factory.mktemp("cluster-pins")))
    yield from running_cluster(spec)


def _pin(cluster: LocalCluster, route: str, key: str = ADMIN, **body) -> httpx.Response:
    return httpx.post(f"{cluster.conductor_url}/v1/kv/{route}", headers=_auth(key), json=body, timeout=60)


def _cached(url: str, prompt: str, salt: str | None = None) -> int:
    """A request straight to one instance, in the namespace `salt` names."""
    body = {"prompt": prompt, "max_tokens": 1, "cache_scope": "shared", **({"cache_salt": salt} if salt else {})}
    r = httpx.post(f"{url}/v1/completions", headers=_auth(INSTANCE_KEY), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _churn(url: str) -> None:
    """Distinct prompts of ~7 blocks each, 48+ blocks in all: every unretained block goes."""
    for i in range(7):
        _cached(url, f"churn {i}: " + f"rivers, bridges and the number {i} counted slowly. " * 9)


def _retained(cluster: LocalCluster) -> dict[str, float]:
    text = httpx.get(f"{cluster.conductor_url}/metrics", headers=_auth(K1), timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvpool_conductor:retained_blocks{"):
            inst = line.split('instance="', 1)[1].split('"', 1)[0]
            out[inst] = float(line.rsplit(" ", 1)[1])
    return out


def _await_retained(cluster: LocalCluster, check, timeout_s: float = 30.0) -> dict[str, float]:
    """The gauge once `check` holds (a later poll of /internal/state carries the retention)."""
    deadline = time.monotonic() + timeout_s
    seen = _retained(cluster)
    while not check(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = _retained(cluster)
    return seen


def test_a_cluster_pin_holds_on_every_instance_through_cache_pressure_until_unpinned(cluster):
    i0, i1 = cluster.urls("both")
    before = _retained(cluster)
    r = _pin(cluster, "pin", prompt=PROMPT, ttl="1h", priority=5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["failed"] == {} and body["scope"] == "server" and body["ttl_seconds"] == 3600
    assert {i: a["pinned_blocks"] >= 3 for i, a in body["instances"].items()} == {"i0": True, "i1": True}
    for url in (i0, i1):  # computed after the pin: pinned as its blocks register
        _cached(url, OTHER)
        _cached(url, PROMPT)
        _churn(url)
        assert _cached(url, PROMPT) >= 48
        assert _cached(url, OTHER) == 0
    seen = _await_retained(cluster, lambda g: all(g[i] >= before[i] + 3 for i in ("i0", "i1")))
    assert all(seen[i] >= before[i] + 3 for i in ("i0", "i1")), seen
    state = httpx.get(f"{cluster.conductor_url}/cluster", headers=_auth(K1), timeout=10).json()
    assert state["cluster_pins"] >= 1

    r = _pin(cluster, "unpin", prompt=PROMPT)
    assert r.status_code == 200, r.text
    assert r.json()["cluster_pins_dropped"] == 1
    assert all(a["unpinned_blocks"] >= 3 for a in r.json()["instances"].values()) and len(r.json()["instances"]) == 2
    seen = _await_retained(cluster, lambda g: all(g[i] <= before[i] for i in ("i0", "i1")))
    assert all(seen[i] <= before[i] for i in ("i0", "i1")), seen
    _churn(i1)
    assert _cached(i1, PROMPT) == 0


@pytest.mark.slow
def test_a_tenant_pins_in_its_own_namespace_only(cluster):
    text = "Tenant one's standing instructions for the quay, pinned by its operator. " * 3
    r = _pin(cluster, "pin", key=K1, prompt=text, cache_salt="quay")
    assert r.status_code == 200 and r.json()["scope"] == "tenant", r.text
    assert all(a["pinned_blocks"] >= 3 for a in r.json()["instances"].values())
    salt1 = KeyRing.build([K1]).tenant(K1.encode()).salt
    # tenant two naming tenant one's salt still acts under its own: nothing of tenant one's is released
    r = _pin(cluster, "unpin", key=K2, prompt=text, cache_salt=f"{salt1}/quay")
    assert r.status_code == 200, r.text
    assert {i: a["unpinned_blocks"] for i, a in r.json()["instances"].items()} == {"i0": 0, "i1": 0}
    assert r.json()["cluster_pins_dropped"] == 0
    i0 = cluster.urls("both")[0]
    _cached(i0, text, salt=f"{salt1}/quay")  # tenant one's blocks, as its requests hash them
    _churn(i0)
    assert _cached(i0, text, salt=f"{salt1}/quay") >= 48
    r = _pin(cluster, "unpin", key=K1, prompt=text, cache_salt="quay")
    assert r.status_code == 200 and r.json()["cluster_pins_dropped"] == 1
    assert all(a["unpinned_blocks"] >= 3 for a in r.json()["instances"].values())
    r = _pin(cluster, "pin", key="not-a-key", prompt=text)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("route", "body", "param"), [
    ("pin", {"prompt": PROMPT, "ttl": "2w"}, "ttl"),
    ("pin", {"prompt": PROMPT, "ttl": "9h", "priority": 101}, "priority"),
    ("pin", {"prompt": PROMPT, "colour": "red"}, "colour"),
    ("pin", {"prompt": "too short"}, "prompt"),
    ("pin", {"prompt": PROMPT, "prefix_tokens": 15}, "prefix_tokens"),
    ("pin", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("pin", {"prompt": PROMPT, "model": "no-such-model"}, "model"),
    ("unpin", {"prompt": PROMPT, "priority": 3}, "priority"),
])
def test_a_bad_body_is_a_400_naming_the_field(cluster, route, body, param):
    r = _pin(cluster, route, **body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


@pytest.mark.slow
def test_a_hung_instance_gives_a_partial_answer_then_gets_the_pin(cluster):
    text = "A notice for every berth, pinned while one instance does not answer at all. " * 3
    hung = cluster.procs["both1"]
    before = _retained(cluster)["i1"]
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        r = _pin(cluster, "pin", prompt=text, ttl="10m")  # the conductor gives up on it after 5 s
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    assert r.status_code == 200, r.text
    assert set(r.json()["instances"]) == {"i0"} and set(r.json()["failed"]) == {"i1"}
    _cached(hung.url, text)  # back: replayed (with the TTL left) or the late request itself
    assert _await_retained(cluster, lambda g: g["i1"] >= before + 3)["i1"] >= before + 3
    _churn(hung.url)
    assert _cached(hung.url, text) >= 48
    assert _pin(cluster, "unpin", prompt=text).status_code == 200


@pytest.mark.slow
def test_a_restarted_instance_is_sent_the_pins_made_while_it_was_down(cluster):
    text = "A tide table every instance should keep, even one that was away at the time. " * 3
    cluster.stop("both1")
    assert not cluster.wait_all_up(up=False)["instances"]["i1"]["up"]
    r = _pin(cluster, "pin", prompt=text)
    assert r.status_code == 200, r.text
    assert set(r.json()["instances"]) == {"i0"} and r.json()["failed"]["i1"].startswith("down")
    cluster.restart("both1")
    assert cluster.wait_all_up()["instances"]["i1"]["up"]
    url = cluster.procs["both1"].url
    _cached(url, text)  # a fresh process: retained only once the conductor replays the pin
    assert _await_retained(cluster, lambda g: g["i1"] >= 3)["i1"] >= 3
    _churn(url)
    assert _cached(url, text) >= 48
    r = _pin(cluster, "unpin", prompt=text)
    assert r.status_code == 200 and set(r.json()["instances"]) == {"i0", "i1"}


@pytest.mark.slow
def test_a_pin_no_instance_takes_is_a_502_and_is_not_kept(cluster):
    text = "A pin nobody hears: every instance is frozen while it is asked to keep this. " * 3

    def pins() -> int:
        return httpx.get(f"{cluster.conductor_url}/cluster", headers=_auth(K1), timeout=10).json()["cluster_pins"]

    before = pins()
    frozen = [cluster.procs[name] for name in ("both0", "both1")]
    for proc in frozen:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        r = _pin(cluster, "pin", prompt=text, ttl="10m")  # each instance given up on after 5 s
    finally:
        for proc in frozen:
            os.kill(proc.pid, signal.SIGCONT)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"]  # an OpenAI-style body naming the failures
    assert pins() == before  # nothing kept, so nothing is replayed to the instances later
    assert cluster.wait_all_up()["instances"]["i0"]["up"]
