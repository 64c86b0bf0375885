"""#31 item 2: slow clients are cut off and one address cannot hold every connection. uvicorn
with `kvpool serve`'s own config (`server_config`, the same flags) on a real socket, in front of
a small echo app: the limits live in the connection layer, so no model is needed."""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from conftest import free_port

from kvpool.cluster import cli as conductor_cli
from kvpool.errors import ConfigError
from kvpool.serve import cli as serve_cli
from kvpool.serve.cli import server_config

WAIT_S = 10.0  # the test's own bound: far above every timeout configured here


async def echo(scope, receive, send) -> None:
    """Reads the whole body, answers with its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


SERVERS = {"serve": serve_cli.add_arguments, "conductor": conductor_cli.add_arguments}


def _args(*flags: str, server: str = "serve") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    SERVERS[server](parser)
    return parser.parse_args(["--port", str(free_port()), *flags])


@contextlib.contextmanager
def running(app, *flags: str, server: str = "serve") -> Iterator[tuple[str, int]]:
    """uvicorn serving `app` with `kvpool serve`'s (or the conductor's) config for `flags`, in a
    thread; its address."""
    args = _args(*flags, server=server)
    server = uvicorn.Server(server_config(app, args))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started
        yield args.host, args.port
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.fixture(params=sorted(SERVERS))
def serve(request) -> Iterator:
    """Both kvpool HTTP servers take the same limits through the same config."""
    with contextlib.ExitStack() as stack:
        yield lambda *flags: stack.enter_context(running(echo, *flags, server=request.param))


def closed_by_server(s: socket.socket, wait_s: float = WAIT_S) -> bytes:
    """Read until the server closes the connection (within `wait_s`); what it sent before."""
    s.settimeout(wait_s)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection for {wait_s} s")
    return got


def _connect(addr: tuple[str, int], source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(addr)
    return s


def test_a_client_trickling_its_headers_is_disconnected(serve):
    addr = serve("--header-timeout", "1")
    with _connect(addr) as s:
        s.sendall(b"GET / HTTP/1.1\r\n")
        closed = threading.Event()

        def trickle() -> None:
            try:
                for byte in b"Host: example\r\nX-Slow: " + b"a" * 100:
                    if closed.is_set():
                        return
                    s.send(bytes([byte]))
                    time.sleep(0.2)
            except OSError:
                pass  # the server closed it

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        got = closed_by_server(s)
        closed.set()
        t.join(WAIT_S)
    assert b"200 OK" not in got


def test_a_body_shorter_than_its_content_length_is_disconnected(serve):
    addr = serve("--body-timeout", "1")
    with _connect(addr) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 20)
        assert b"200 OK" not in closed_by_server(s)


def test_a_connection_that_sends_nothing_is_disconnected(serve):
    addr = serve("--header-timeout", "1")
    with _connect(addr) as s:
        assert closed_by_server(s) == b""


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(serve):
    addr = serve("--timeout-keep-alive", "1")
    with _connect(addr) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in closed_by_server(s)


def test_slow_clients_within_the_limits_are_served_on_one_keep_alive_connection(serve):
    addr = serve("--header-timeout", "5", "--body-timeout", "5")
    with _connect(addr) as s:
        s.settimeout(WAIT_S)
        for _ in range(2):
            for part in (b"POST / HTTP/1.1\r\nHost: x\r\n", b"Content-Length: 6\r\n\r\n", b"abc", b"def"):
                s.sendall(part)
                time.sleep(0.2)
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"6"), reply


def test_connections_beyond_the_cap_from_one_address_are_refused_while_others_are_served(serve):
    host, port = serve("--max-connections-per-client", "3", "--header-timeout", "30")
    held = [_connect((host, port)) for _ in range(3)]
    try:
        with _connect((host, port)) as extra:
            extra.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"200" not in closed_by_server(extra)
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        with other:
            assert other.get(f"http://{host}:{port}/").status_code == 200
        held.pop().close()
        deadline = time.monotonic() + WAIT_S
        while True:  # the server sees the close on its next loop turn
            try:
                if httpx.get(f"http://{host}:{port}/").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "a freed slot was never reused"
                time.sleep(0.05)
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("flags", [["--header-timeout", "0"], ["--body-timeout", "-1"],
                                   ["--timeout-keep-alive", "0"], ["--max-connections-per-client", "-1"]])
def test_bad_limits_are_refused_by_flag(flags):
    with pytest.raises(ConfigError, match=flags[0]):
        server_config(echo, _args(*flags))
