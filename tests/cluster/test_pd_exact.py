"""#27 acceptance (e): greedy completions through a 1 prefill + 1 decode cluster over Redis (the
prompt's KV computed on one instance, moved through the pool, decoded on the other) are a single
engine's tokens and logprobs, bit for bit (exact equality of the JSON floats), in bfloat16 (the
default dtype) and float32. The first token's logprob comes from the prefill instance that
sampled it, the others from the decode instance; `prompt_logprobs` from the prefill instance."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from cluster_helpers import running_cluster

from kvpool.cluster.local import ClusterSpec, LocalCluster
from kvpool.engine.llm import LLM
from kvpool.sched.sampling_params import SamplingParams
from kvpool.serve.responses import completion_logprobs, vllm_prompt_logprobs

API_KEY = "pd-exact-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
DOC = " ".join(f"Entry {i}: the depot shipped {i * 5} boxes of nails and {i + 4} coils of rope." for i in range(6))
PROMPTS = [f"{DOC}\nQuestion: how many boxes in entry {i}?\nAnswer:" for i in (1, 4)] + ["The river bends at"]
MAX_TOKENS = 8
TOP = 2  # top logprobs per token


@pytest.fixture(scope="module", params=["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def cluster(dtype: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    args = ["--dtype", dtype, "--num-blocks", "128", "--max-model-len", "512", "--threads", "1"]
    spec = ClusterSpec(prefill=1, decode=1, pool="redis", instance_args=args, api_key=API_KEY,
                       log_dir=str(tmp_path_factory.mktemp("pd-exact")))
    yield from running_cluster(spec)


@pytest.fixture(scope="module")
def single(dtype: str) -> LLM:
    return LLM(num_blocks=128, max_model_len=512, threads=1, dtype=dtype)


async def _completion(c: httpx.AsyncClient, body: dict) -> dict:
    """One choice, whole or from its stream (texts joined, logprob lists concatenated)."""
    if not body.get("stream"):
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    text, lps = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        for ch in json.loads(e)["choices"]:
            text += ch["text"]
            for k in lps:
                lps[k] += ch["logprobs"][k]
    return {"text": text, "logprobs": lps}


def test_pd_greedy_tokens_and_logprobs_equal_a_single_engines(cluster: LocalCluster, single: LLM) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP, ignore_eos=True)
    outs = [o.outputs[0] for o in single.generate(PROMPTS, params, use_tqdm=False)]
    expected = [(o.text, completion_logprobs(single.tokenizer, o, 0, 0)) for o in outs]
    assert all(len(lps["token_logprobs"]) == MAX_TOKENS for _, lps in expected)

    async def run(stream: bool) -> list[tuple[str, dict]]:
        async with httpx.AsyncClient(base_url=cluster.conductor_url, headers=AUTH, timeout=600) as c:
            got = await asyncio.gather(*(_completion(c, {
                "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": TOP, "stream": stream,
                "ignore_eos": True}) for p in PROMPTS))
        return [(g["text"], g["logprobs"]) for g in got]

    assert asyncio.run(run(stream=False)) == expected  # floats compared with ==: the same bits
    assert asyncio.run(run(stream=True)) == expected  # the shared document's blocks now in the pool too


def test_pd_prompt_logprobs_equal_a_single_engines(cluster: LocalCluster, single: LLM) -> None:
    """max_tokens 0 scores the prompt on the prefill instance alone; 2 also decodes one token."""
    prompt = PROMPTS[0]
    for max_tokens in (0, 2):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, prompt_logprobs=TOP, ignore_eos=True)
        want = single.generate([prompt], params, use_tqdm=False)[0]
        r = httpx.post(cluster.conductor_url + "/v1/completions", headers=AUTH, timeout=600, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0, "prompt_logprobs": TOP,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["prompt_logprobs"] == vllm_prompt_logprobs(single.tokenizer, want, TOP)
        assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(want.prompt_token_ids)
        assert choice["logprobs"] == completion_logprobs(single.tokenizer, want.outputs[0], 0, 0)
        assert len(choice["logprobs"]["token_logprobs"]) == max_tokens
        assert r.json()["usage"]["completion_tokens"] == max_tokens
