"""A second small server with --max-queue 1: overload is a 429 with Retry-After, and SIGTERM
drains in-flight work and exits 0."""

from __future__ import annotations

import asyncio
import signal
import threading

import httpx
import pytest
from conftest import start_server


@pytest.fixture(scope="module")
def small_server():
    s = start_server("--max-queue", "1", "--max-num-seqs", "2", "--shutdown-timeout", "60")
    yield s
    s.stop()


def test_burst_beyond_the_queue_limit_gets_429_with_retry_after(small_server):
    body = {"prompt": "Tell me about queues.", "max_tokens": 8, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=small_server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "server_overloaded"
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 8
    assert small_server.metrics()["kvpool:request_rejected_total"] == codes.count(429)


def test_sigterm_lets_the_in_flight_stream_finish_then_exits_zero(small_server):
    body = {"prompt": "Drain me.", "max_tokens": 24, "ignore_eos": True, "stream": True}
    chunks: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{small_server.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line)
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    small_server.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert small_server.proc.wait(120) == 0
    assert chunks[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in chunks[-2]
