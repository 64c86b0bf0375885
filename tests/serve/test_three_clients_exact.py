"""#27 acceptance: three concurrent clients of one real `kvpool serve` with mixed features (n=2
with a seed at temperature > 0, a greedy json_object chat, prompt_logprobs) get exactly what each
got alone: the same choices, texts, logprobs and prompt logprobs, whether their prefixes hit the
cache (the solo runs left them there) or not (a fresh cache_salt each), in bfloat16 (the default
dtype) and float32."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from conftest import Server, start_server, wait_idle

REQUESTS = [
    ("/v1/completions", {"prompt": "The old lighthouse keeper kept a log of ships:", "max_tokens": 6, "n": 2,
                         "temperature": 0.8, "seed": 3, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Give a JSON object with a name."}],
                              "max_tokens": 10, "temperature": 0, "response_format": {"type": "json_object"},
                              "logprobs": True}),
    ("/v1/completions", {"prompt": "Three ports on the northern coast are", "max_tokens": 4, "temperature": 0,
                         "prompt_logprobs": 1, "logprobs": 0}),
]


@pytest.fixture(scope="module", params=["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def server(request) -> Iterator[Server]:
    s = start_server("--dtype", request.param, "--threads", "1")
    yield s
    assert s.stop() == 0, s.log.read_text()


def _result(r: httpx.Response) -> list[dict]:
    """What a client relies on: every choice (text or message, logprobs, prompt logprobs, finish
    reason); not the ids, timestamps or usage (cached tokens differ by design)."""
    assert r.status_code == 200, r.text
    return r.json()["choices"]


async def _send(server: Server, salts: list[str | None]) -> list[list[dict]]:
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
        rs = await asyncio.gather(*(c.post(path, json={**body, **({"cache_salt": s} if s else {})})
                                    for (path, body), s in zip(REQUESTS, salts, strict=True)))
    return [_result(r) for r in rs]


def test_three_concurrent_clients_get_their_solo_outputs(server: Server) -> None:
    solo = []
    for i in range(len(REQUESTS)):
        assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
        (path, body) = REQUESTS[i]
        solo.append(_result(httpx.post(f"{server.url}{path}", json=body, timeout=600)))
    assert len(solo[0]) == 2 and solo[2][0]["prompt_logprobs"] and solo[1][0]["logprobs"]["content"]
    assert asyncio.run(_send(server, [None] * 3)) == solo  # the solo runs' prefixes are cached: hits
    assert asyncio.run(_send(server, ["a", "b", "c"])) == solo  # salted: nothing hits, all cold together
    m = wait_idle(server)
    assert m["kvpool:kv_blocks_free"] == m["kvpool:kv_blocks_capacity"]
