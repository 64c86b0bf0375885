"""The real cluster: 2 prefill + 2 decode `kvpool serve` processes, a Redis KV pool and a
`kvpool conductor`, all on free loopback ports, shared by the tests of this module."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from cluster_helpers import running_cluster

from kvpool.cluster.local import ClusterSpec, LocalCluster
from kvpool.engine.llm import LLM
from kvpool.sched.sampling_params import SamplingParams

INSTANCE_ARGS = ["--dtype", "float32", "--num-blocks", "256", "--max-model-len", "1024", "--threads", "1"]
API_KEY = "conductor-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
DOC = " ".join(f"Section {i}: the harbour ledger lists {i * 7} crates of tea, {i * 3} bales of wool "
               f"and {i + 2} casks of wine." for i in range(14))
QUESTIONS = ["How many crates are listed?", "What is in section 3?", "Summarise the ledger.",
             "Which cargo is rarest?"]
DISTINCT = ["The capital of France is", "Write a haiku about rain:", "def fibonacci(n):",
            "A short list of prime numbers:"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(prefill=2, decode=2, pool="redis", instance_args=INSTANCE_ARGS,
                       conductor_args=["--policy", "kv-centric"], api_key=API_KEY,
                       log_dir=str(tmp_path_factory.mktemp("cluster")))
    yield from running_cluster(spec)


@pytest.fixture(scope="module")
def reference() -> LLM:
    """A single colocated engine: what every greedy completion must equal."""
    return LLM(num_blocks=256, max_model_len=1024, threads=1, dtype="float32")


def _client(cluster: LocalCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.conductor_url + "/v1", api_key=API_KEY, max_retries=0)


async def _complete(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, stream: bool, **extra) -> str:
    if not stream:
        r = await client.completions.create(model="", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            **extra)
        return r.choices[0].text
    parts = []
    async for chunk in await client.completions.create(model="", prompt=prompt, max_tokens=max_tokens,
                                                       temperature=0, stream=True, **extra):
        parts.extend(c.text for c in chunk.choices)
    return "".join(parts)


def _wait_idle(cluster: LocalCluster, timeout_s: float = 30.0) -> dict:
    """Each instance's /internal/state load once nothing runs or waits and every block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {u: httpx.get(u + "/internal/state", params={"since": 1 << 60},
                              headers=cluster.cluster_headers).json()["load"]
                 for role in ("prefill", "decode") for u in cluster.urls(role)}
        idle = all(x["running"] == 0 and x["waiting"] == 0 and x["free_kv_blocks"] == x["total_kv_blocks"]
                   for x in loads.values())
        if idle or time.monotonic() > deadline:
            return loads


def test_mixed_workload_matches_a_single_engine_and_leaks_nothing(cluster: LocalCluster, reference: LLM) -> None:
    prompts = [f"{DOC}\nQuestion: {q}\nAnswer:" for q in QUESTIONS] + DISTINCT
    max_tokens = 12
    expected = [o.outputs[0].text for o in reference.generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)]

    async def run() -> list[str]:
        client = _client(cluster)
        return await asyncio.gather(*(_complete(client, p, max_tokens, stream=i % 2 == 1)
                                      for i, p in enumerate(prompts)))

    assert asyncio.run(run()) == expected
    loads = _wait_idle(cluster)
    for url, load in loads.items():
        assert load["running"] == 0 and load["waiting"] == 0, (url, load)
        assert load["free_kv_blocks"] == load["total_kv_blocks"], (url, load)
    state = httpx.get(cluster.conductor_url + "/cluster", headers=AUTH).json()
    assert state["in_flight"] == 0
    assert state["gateway"]["completed"] >= len(prompts)
    assert state["pool_blocks"] > 0  # the pool holds the shared document's blocks
    metrics = httpx.get(cluster.conductor_url + "/metrics", headers=AUTH).text
    assert 'kvpool_conductor:instance_up{instance="d1",role="decode"} 1.0' in metrics


def test_a_burst_on_one_document_replicates_its_blocks(cluster: LocalCluster) -> None:
    doc = DOC.replace("harbour", "river")

    async def burst() -> None:
        client = _client(cluster)
        await asyncio.gather(*(_complete(client, f"{doc}\nNote {i}:", 2, stream=False) for i in range(6)))

    asyncio.run(burst())
    deadline = time.monotonic() + 10
    while True:
        match = httpx.post(cluster.conductor_url + "/cluster/match", json={"prompt": doc}, headers=AUTH).json()
        prefill_holders = [i for i, n in match["holders"].items() if i in ("p0", "p1") and n > 0]
        if len(prefill_holders) > 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(prefill_holders) == ["p0", "p1"], match


def test_rejects_what_it_cannot_serve_in_openai_shape(cluster: LocalCluster) -> None:
    r = httpx.post(cluster.conductor_url + "/v1/completions", json={"prompt": "hi", "n": 2}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(cluster.conductor_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5000},
                   headers=AUTH)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r = httpx.post(cluster.conductor_url + "/v1/completions", json={"prompt": "hi", "seed": 2**70}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_a_chat_through_the_conductor_equals_a_single_engines_chat(cluster: LocalCluster, reference: LLM) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    r = httpx.post(cluster.conductor_url + "/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"messages": messages, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    want = reference.chat(messages, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    assert r.json()["choices"][0]["message"]["content"] == want
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = httpx.post(cluster.conductor_url + "/v1/chat/completions", headers=AUTH,
                   json={"messages": messages, "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_the_conductor_and_the_instances_internal_routes_need_their_keys(cluster: LocalCluster) -> None:
    for path in ("/cluster", "/metrics", "/v1/models"):
        assert httpx.get(cluster.conductor_url + path).status_code == 401, path
        assert httpx.get(cluster.conductor_url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(cluster.conductor_url + "/cluster/match", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(cluster.conductor_url + "/health").status_code == 200
    url = cluster.urls("prefill")[0]
    for headers in ({}, AUTH):  # the conductor's client key does not open an instance's /internal routes
        assert httpx.get(url + "/internal/state", headers=headers).status_code == 401
        assert httpx.post(url + "/internal/generate", headers=headers,
                          json={"prompt": [1, 2], "max_tokens": 1}).status_code == 401
    assert httpx.get(url + "/internal/state", headers=cluster.cluster_headers).status_code == 200


def test_a_killed_decode_instance_fails_its_requests_and_the_cluster_keeps_serving(
        cluster: LocalCluster) -> None:
    async def long_requests() -> list[str | Exception]:
        client = _client(cluster)
        tasks = [asyncio.ensure_future(_complete(client, f"Story {i}: once upon a time", 96, stream=False,
                                                 extra_body={"ignore_eos": True})) for i in range(4)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # kill d0 once it is decoding something
            load = httpx.get(cluster.procs["decode0"].url + "/internal/state",
                             params={"since": 1 << 60}, headers=cluster.cluster_headers).json()["load"]
            if load["running"]:
                break
            await asyncio.sleep(0.05)
        cluster.stop("decode0", sig=signal.SIGKILL)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(long_requests())
    failed = [r for r in results if isinstance(r, Exception)]
    assert failed, results
    for e in failed:
        assert isinstance(e, openai.APIStatusError) and e.status_code == 502, e
        assert "instance d0" in e.body["message"]
    state = cluster.wait_all_up(10.0, up=False)
    assert state["instances"]["d0"]["up"] is False
    assert state["instances"]["d1"]["up"] is True
    text = asyncio.run(_complete(_client(cluster), "The capital of France is", 8, stream=True))
    assert text
    cluster.restart("decode0")
    state = cluster.wait_all_up(30.0)
    assert state["instances"]["d0"]["up"] is True
