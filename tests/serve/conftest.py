"""Real `kvpool serve` subprocesses on free loopback ports, shared by the serve tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

# small and fast: 256 blocks x 16 tokens, a 1024-token context
SERVER_ARGS = ["--num-blocks", "256", "--max-model-len", "1024", "--max-num-seqs", "64"]
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: sample name -> value (labels dropped)."""
        text = httpx.get(f"{self.url}/metrics").text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out


def start_server(*extra: str, startup_timeout_s: float = 180.0) -> Server:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="kvpool-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "kvpool.cli", "serve", "--port", str(port), *SERVER_ARGS, *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"server did not become healthy:\n{log.read_text()}")


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    s = start_server("--api-key", API_KEY)
    yield s
    assert s.stop() == 0, s.log.read_text()


@pytest.fixture(scope="session")
def model_id(server: Server) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]


def wait_idle(server: Server, timeout_s: float = 30.0) -> dict[str, float]:
    """Metrics once nothing runs or waits (the engine thread updates them after each turn)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = m["kvpool:num_requests_running"] == 0 and m["kvpool:num_requests_waiting"] == 0
        if idle and m["kvpool:kv_blocks_free"] == m["kvpool:kv_blocks_capacity"] or time.monotonic() > deadline:
            return m
        time.sleep(0.05)
