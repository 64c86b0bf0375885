"""Start and stop local redis-server and mooncake_master processes on free loopback ports.

Used by the tests' session fixtures and by cluster tooling. Each service is a child process
stopped by its pid; a port is picked free just before starting and re-picked if taken.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.errors import KVPoolError

log = logging.getLogger(__name__)


class ServiceError(KVPoolError):
    """A local service binary is missing or did not become ready in time."""


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def find_binary(name: str) -> str:
    """`name` from the running interpreter's bin directory (a venv) or from PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise ServiceError(f"{name} not found next to {sys.executable} nor on PATH; "
                           "run scripts/install_remote_pools.sh")
    return found


@dataclass(slots=True)
class LocalService:
    """A child process serving on 127.0.0.1:`port`."""

    name: str
    argv: list[str]
    port: int
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, timeout_s: float = 15.0) -> None:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not _port_open(self.port):
            if self.proc.poll() is not None:
                raise ServiceError(f"{self.name} exited with {self.proc.returncode} before "
                                   f"listening on port {self.port}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceError(f"{self.name} not listening on port {self.port} after {timeout_s}s")
            time.sleep(0.05)
        log.info("%s listening on 127.0.0.1:%d (pid %d)", self.name, self.port, self.proc.pid)

    def stop(self) -> None:
        """Terminate by pid (kill after 5 s) and reap; a no-op when not running."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout_s: float = 15.0) -> None:
        """Stop, then start again on the same port (state is lost: no persistence)."""
        self.stop()
        self.start(timeout_s)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def redis_service(maxmemory: str = "0", policy: str = "allkeys-lru", log_path: Path | None = None) -> LocalService:
    """A redis-server without persistence; `maxmemory` 0 means unbounded."""
    port = free_port()
    argv = [find_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--maxmemory", maxmemory, "--maxmemory-policy", policy]
    return LocalService("redis-server", argv, port, log_path)


def mooncake_master_service(lease_ttl_ms: int = 10_000, log_path: Path | None = None) -> LocalService:
    """A mooncake_master with its RPC and metrics on free loopback ports."""
    port = free_port()
    argv = [find_binary("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
            f"--metrics_port={free_port()}", "--enable_metric_reporting=false",
            f"--default_kv_lease_ttl={lease_ttl_ms}"]
    return LocalService("mooncake_master", argv, port, log_path)

