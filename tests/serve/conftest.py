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
SERVER_ARGS = ["--dtype", "float32", "--num-blocks", "256", "--max-model-len", "1024", "--max-num-seqs", "64"]
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
OTHER_KEY = "other-tenant-key"  # a second tenant of the session server
OTHER_AUTH = {"Authorization": f"Bearer {OTHER_KEY}"}
SERVER_CLUSTER_KEY = "test-cluster-key"
MAX_REQUEST_BYTES = 256 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    headers: dict[str, str]  # what /metrics needs
    initial_metrics: dict[str, float] | None = None  # /metrics as soon as /health said 200

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
        r = httpx.get(f"{self.url}/metrics", headers=self.headers)
        assert r.status_code == 200, r.text
        text = r.text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out


def start_server(*extra: str, startup_timeout_s: float = 600.0, headers: dict[str, str] | None = None) -> Server:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="kvpool-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "kvpool.cli", "serve", "--port", str(port), *SERVER_ARGS, *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(proc, f"http://127.0.0.1:{port}", log, headers or {})
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                server.initial_metrics = server.metrics()
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"server did not become healthy:\n{log.read_text()}")


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    s = start_server("--api-key", API_KEY, "--api-key", OTHER_KEY, "--role", "both", "--cluster-key",
                     SERVER_CLUSTER_KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES), headers=AUTH)
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


@pytest.fixture(scope="session")
def hf_model():
    """transformers' LlamaForCausalLM on the bundled GGUF in fp32, dequantized by transformers itself:
    the reference kvpool's numbers are held to."""
    import warnings

    import torch

    from kvpool.engine.loader import default_model_path

    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
    return model.eval()


# -- the app in-process (fuzzing, route tables): a real engine, no subprocess -------------------
KEYS = ("tenant-a-key", "tenant-b-key")
CLUSTER_KEY = "cluster-key"


def build_inprocess_app(**server_kwargs):
    """The server's app around a real engine on the bundled model, as `kvpool serve --role both`
    with two API keys and a cluster key builds it."""
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import Engine
    from kvpool.serve.app import build_app
    from kvpool.serve.async_engine import AsyncEngine
    from kvpool.serve.auth import KeyRing
    from kvpool.serve.internal import build_internal_router
    from kvpool.serve.metrics import ServerMetrics
    from kvpool.serve.state import ServerState

    config = EngineConfig(num_blocks=128, max_model_len=512, max_num_seqs=32, publish_kv_events=True, threads=1)
    engine = AsyncEngine.launch(lambda: Engine(config), lambda e: ServerMetrics(e.loaded.name), watchdog_s=60.0)
    e = engine.engine
    state = ServerState(engine=engine, tokenizer=e.tokenizer, model_name=e.loaded.name, aliases=frozenset(),
                        max_model_len=e.max_model_len, kv_capacity_tokens=128 * 16,
                        vocab_size=e.loaded.config.vocab_size, keys=KeyRing.build(KEYS, CLUSTER_KEY))
    app = build_app(state, shutdown_timeout_s=5.0, **server_kwargs)
    app.include_router(build_internal_router(state, "both", None))
    return app, state


@pytest.fixture(scope="session")
def inprocess():
    """(TestClient, ServerState) of one in-process app, shared by the session."""
    from starlette.testclient import TestClient

    app, state = build_inprocess_app()
    with TestClient(app) as client:
        yield client, state
