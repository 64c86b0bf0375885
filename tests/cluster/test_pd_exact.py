"""#27 acceptance (e): greedy completions through a 1 prefill + 1 decode cluster over Redis (the
prompt's KV computed on one instance, moved through the pool, decoded on the other) are a single
engine's tokens, in bfloat16 (the default dtype) and float32. The conductor does not relay
logprobs (refused by name: test_gateway), so the tokens are compared; the engine-level tests
(tests/engine/test_exact_reuse_paths.py) compare the logprobs of the same store paths bitwise."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from cluster_helpers import running_cluster

from kvpool.cluster.local import ClusterSpec, LocalCluster
from kvpool.engine.llm import LLM
from kvpool.sched.sampling_params import SamplingParams

API_KEY = "pd-exact-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
DOC = " ".join(f"Entry {i}: the depot shipped {i * 5} boxes of nails and {i + 4} coils of rope." for i in range(6))
PROMPTS = [f"{DOC}\nQuestion: how many boxes in entry {i}?\nAnswer:" for i in (1, 4)] + ["The river bends at"]
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def cluster(dtype: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    args = ["--dtype", dtype, "--num-blocks", "128", "--max-model-len", "512", "--threads", "1"]
    spec = ClusterSpec(prefill=1, decode=1, pool="redis", instance_args=args, api_key=API_KEY,
                       log_dir=str(tmp_path_factory.mktemp("pd-exact")))
    yield from running_cluster(spec)


def test_pd_greedy_tokens_equal_a_single_engines(cluster: LocalCluster, dtype: str) -> None:
    single = LLM(num_blocks=128, max_model_len=512, threads=1, dtype=dtype)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    expected = [o.outputs[0].text for o in single.generate(PROMPTS, params, use_tqdm=False)]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster.conductor_url, headers=AUTH, timeout=600) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={
                "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}) for p in PROMPTS))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(run()) == expected
    again = asyncio.run(run())  # the shared document's blocks are in the pool and the instances now
    assert again == expected
