"""A second small server with --max-queue 1: overload is a 429 with Retry-After; SIGTERM keeps
the listener open answering 503, lets a short stream finish, ends a long one at
--shutdown-timeout with an error event and [DONE], and exits 0 (#13 item 11)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
from conftest import start_server


@pytest.fixture(scope="module")
def small_server():
    # room for a 4000-token stream, which a 5 s drain cannot finish (1.25 ms a step; a CPU takes 5-50)
    s = start_server("--max-queue", "1", "--max-num-seqs", "2", "--shutdown-timeout", "5",
                     "--max-model-len", "4096", "--num-blocks", "512")
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


def _stream(url: str, max_tokens: int, chunks: list[str], started: threading.Event) -> None:
    body = {"prompt": "Drain me.", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line)
                started.set()


def test_sigterm_drains_with_503_then_cuts_what_is_left_with_an_error_event(small_server):
    short: list[str] = []
    long: list[str] = []  # cut by the drain (see the fixture)
    events = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(small_server.url, n, out, e))
               for n, out, e in ((6, short, events[0]), (4000, long, events[1]))]
    for t, e in zip(threads, events, strict=True):  # one after the other: --max-queue 1 holds one waiting
        t.start()
        assert e.wait(60)
    small_server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:  # the listener stays open: a new request gets an answer, 503 once draining began
        r = httpx.post(f"{small_server.url}/v1/completions", json={"prompt": "late", "max_tokens": 1}, timeout=30)
        if r.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert httpx.get(f"{small_server.url}/health").status_code == 503
    for t in threads:
        t.join(120)
    assert small_server.proc.wait(120) == 0
    assert short[-1] == "data: [DONE]" and '"finish_reason": "length"' in short[-2]
    assert long[-1] == "data: [DONE]"
    error = json.loads(long[-2][6:])["error"]
    assert error["code"] == "shutting_down" and "shut down" in error["message"]
