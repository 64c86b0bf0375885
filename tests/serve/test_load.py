"""Many concurrent streaming clients on loopback, some hanging up mid-stream: every other
request completes with exactly max_tokens, and afterwards nothing runs and no block is held."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from conftest import AUTH, wait_idle

SHARED = "You are a helpful assistant. Answer briefly and precisely. " * 3


async def _client(c: httpx.AsyncClient, model: str, i: int, rng: random.Random, disconnect: bool) -> int | None:
    """Tokens received (from the usage chunk), or None for a client that hung up on purpose."""
    if i % 2:
        prompt = SHARED + f"Question {i}: what is {i} + {i}?"
    else:
        prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kv", "cache"]) for _ in range(20))
    max_tokens = 8 + i % 9
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.7, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                assert data["usage"]["completion_tokens"] == max_tokens
                return max_tokens
            chunks += 1
            if disconnect and chunks == 2:
                return None
    raise AssertionError(f"client {i}: stream ended without usage")


def run_load(server, model: str, clients: int) -> None:
    rng = random.Random(0)

    async def main() -> list[int | None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300, limits=limits) as c:
            return await asyncio.gather(*(_client(c, model, i, rng, disconnect=i % 10 == 3) for i in range(clients)))

    results = asyncio.run(main())
    assert sum(r is None for r in results) == len([i for i in range(clients) if i % 10 == 3])
    m = wait_idle(server)
    assert m["kvpool:num_requests_running"] == 0 and m["kvpool:num_requests_waiting"] == 0
    assert m["kvpool:kv_blocks_free"] == m["kvpool:kv_blocks_capacity"]


def test_16_streaming_clients_with_disconnects_leave_no_blocks_held(server, model_id):
    run_load(server, model_id, 16)


@pytest.mark.slow
def test_200_streaming_clients_with_disconnects_leave_no_blocks_held(server, model_id):
    run_load(server, model_id, 200)
