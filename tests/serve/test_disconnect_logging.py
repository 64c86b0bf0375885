"""#31 item 6: a client that hangs up on a non-streaming request is normal traffic: its request
is aborted and one debug line is logged, never an ERROR with a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest
from conftest import API_KEY

from kvpool.serve.gate import QuietDisconnect


async def _hung_up(scope, receive, send):
    raise asyncio.CancelledError("client disconnected")  # what unless_disconnected raises


def test_a_hang_up_is_one_debug_line_and_no_error(caplog):
    caplog.set_level(logging.DEBUG, logger="kvpool.serve.gate")
    asyncio.run(QuietDisconnect(_hung_up)({"type": "http", "method": "POST", "path": "/v1/completions"}, None, None))
    records = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.DEBUG]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_real_cancellation_of_the_task_still_propagates():
    async def slow(scope, receive, send):
        await asyncio.sleep(60)

    async def main() -> None:
        task = asyncio.ensure_future(QuietDisconnect(slow)({"type": "http"}, None, None))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def _aborted(server) -> float:
    return server.metrics()["kvpool:request_aborted_total"]


def test_a_real_server_logs_no_traceback_when_a_client_leaves(server, model_id):
    before, log_start = _aborted(server), server.log.stat().st_size
    body = json.dumps({"model": model_id, "prompt": "Write a long story about a lighthouse.", "max_tokens": 500,
                       "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while server.metrics()["kvpool:num_requests_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    deadline = time.monotonic() + 30
    while _aborted(server) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _aborted(server) == before + 1
    time.sleep(0.5)  # anything the server logs about it is written by now
    with open(server.log, "rb") as f:
        f.seek(log_start)
        tail = f.read().decode(errors="replace")
    assert "Traceback" not in tail and "Exception in ASGI application" not in tail, tail
