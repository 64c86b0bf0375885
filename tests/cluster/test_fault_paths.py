"""#31 item 8, the cluster's fault paths with real processes: 1 prefill + 2 decode `kvpool serve`
instances, a Redis pool and a conductor. A decode instance SIGKILLed mid-stream ends its streams
with an error event, the conductor keeps serving on the other one, and the restarted instance
serves again; /internal routes answer only this cluster's key (slow: three model loads)."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from cluster_helpers import running_cluster

from kvpool.cluster.local import ClusterSpec, LocalCluster

pytestmark = pytest.mark.slow

INSTANCE_ARGS = ["--dtype", "float32", "--num-blocks", "256", "--max-model-len", "1024", "--threads", "1"]
API_KEY = "fault-paths-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(prefill=1, decode=2, pool="redis", instance_args=INSTANCE_ARGS, api_key=API_KEY,
                       log_dir=str(tmp_path_factory.mktemp("fault-cluster")))
    yield from running_cluster(spec)


def _load(cluster: LocalCluster, name: str) -> dict:
    return httpx.get(cluster.procs[name].url + "/internal/state", params={"since": 1 << 60},
                     headers=cluster.cluster_headers, timeout=5).json()["load"]


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, bool]:
    """(text, ended with an error event); a stream always ends with [DONE]."""
    text, error, done = "", False, False
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = True
            else:
                text += "".join(c["text"] for c in chunk["choices"])
    assert done
    return text, error


def test_internal_routes_answer_only_this_clusters_key(cluster: LocalCluster) -> None:
    other_cluster = {"Authorization": f"Bearer {secrets.token_urlsafe(24)}"}
    refused = ({}, {"Authorization": "Bearer wrong"}, other_cluster, AUTH)
    for role in ("prefill", "decode"):
        for url in cluster.urls(role):
            for headers in refused:
                assert httpx.get(url + "/internal/state", headers=headers).status_code == 401, (url, headers)
                r = httpx.post(url + "/internal/generate", headers=headers, json={"prompt": [1, 2], "max_tokens": 1})
                assert r.status_code == 401, (url, headers)
            assert httpx.get(url + "/internal/state", headers=cluster.cluster_headers).status_code == 200
    for headers in ({}, other_cluster, cluster.cluster_headers):  # the conductor has no /internal routes to show
        assert httpx.get(cluster.conductor_url + "/internal/state", headers=headers).status_code == 401
    assert httpx.get(cluster.conductor_url + "/internal/state", headers=AUTH).status_code == 404


def test_a_decode_instance_killed_mid_stream_and_restarted_while_the_conductor_serves(cluster) -> None:
    async def run() -> tuple[list[tuple[str, bool]], str]:
        async with httpx.AsyncClient(base_url=cluster.conductor_url, headers=AUTH, timeout=300) as c:
            streams = [asyncio.ensure_future(_stream(c, f"Voyage {i}: the ship left the harbour", 160))
                       for i in range(4)]
            deadline = time.monotonic() + 60
            while not _load(cluster, "decode0")["running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _load(cluster, "decode0")["running"], "no stream reached decode0"
            cluster.stop("decode0", sig=signal.SIGKILL)
            during, _ = await _stream(c, "While one decode instance is down,", 8)
            return await asyncio.gather(*streams), during

    results, during = asyncio.run(run())
    assert during  # served by the other decode instance meanwhile
    assert any(error for _, error in results), results  # decode0's streams ended with an error event
    assert all(text for text, error in results if not error)  # the others ran to their end
    cluster.restart("decode0")
    state = cluster.wait_all_up(60.0)
    assert state["instances"]["d0"]["up"] is True

    async def after() -> list[tuple[str, bool]]:
        async with httpx.AsyncClient(base_url=cluster.conductor_url, headers=AUTH, timeout=300) as c:
            return await asyncio.gather(*(_stream(c, f"After the restart, story {i}:", 24) for i in range(4)))

    assert all(text and not error for text, error in asyncio.run(after()))
    restarted = httpx.get(cluster.procs["decode0"].url + "/metrics").text
    generated = [line for line in restarted.splitlines() if line.startswith("kvpool:generation_tokens_total")]
    assert generated and float(generated[0].rsplit(" ", 1)[1]) > 0  # the restarted instance serves again
