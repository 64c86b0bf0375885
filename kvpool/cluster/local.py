"""Bring up a whole cluster on this machine: a shared KV pool (redis-server or mooncake_master),
prefill / decode (or colocated) `kvpool serve` instances and a `kvpool conductor`, each a
subprocess on a free loopback port. Used by `kvpool cluster up|down`, the tests and
`kvpool bench cluster`. A state file records every pid, so `down` stops exactly what `up`
started. Every process gets a fresh random cluster key (through the environment, not argv), so
the instances' /internal routes answer only this cluster's conductor.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvpool.errors import ConfigError, KVPoolError
from kvpool.serve.auth import CLUSTER_KEY_ENV
from kvpool.store.services import free_port, mooncake_master_service, redis_service

logger = logging.getLogger(__name__)

POOLS = ("redis", "mooncake", "none")


class ClusterError(KVPoolError):
    """A cluster process exited or did not become healthy in time."""


@dataclass(slots=True)
class ClusterSpec:
    """`colocated` > 0 starts `--role both` instances instead of prefill/decode ones."""

    prefill: int = 2
    decode: int = 2
    colocated: int = 0
    pool: str = "redis"
    instance_args: list[str] = field(default_factory=list)  # extra `kvpool serve` flags for every instance
    decode_args: list[str] = field(default_factory=list)  # extra flags for decode instances only
    conductor_args: list[str] = field(default_factory=list)  # extra `kvpool conductor` flags
    log_dir: str = ""
    api_key: str | None = None  # the conductor's client API key (None: its routes are open)

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ConfigError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ConfigError("instance counts must be >= 0")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ConfigError(f"need >= 1 prefill and >= 1 decode instance, got {self.prefill} and {self.decode}")
        if not self.colocated and self.pool == "none":
            raise ConfigError("prefill/decode disaggregation moves KV through the pool: choose redis or mooncake")


@dataclass(slots=True)
class Proc:
    """One started process, as written to the state file."""

    name: str
    role: str  # pool | prefill | decode | both | conductor
    pid: int
    port: int
    url: str
    log: str
    argv: list[str]


def _python_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvpool.cli", "--log-level", "WARNING", *args]


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.procs: dict[str, Proc] = {}
        self._popen: dict[str, subprocess.Popen] = {}
        self.log_dir = Path(spec.log_dir or f"/tmp/kvpool-cluster-{os.getpid()}-{time.time_ns() % 10**6}")
        self.pool_url: str | None = None
        self.cluster_key = secrets.token_urlsafe(24)

    @property
    def conductor_url(self) -> str:
        return self.procs["conductor"].url

    def urls(self, role: str) -> list[str]:
        return [p.url for p in self.procs.values() if p.role == role]

    @property
    def cluster_headers(self) -> dict[str, str]:
        """What an instance's /internal routes need."""
        return {"Authorization": f"Bearer {self.cluster_key}"}

    @property
    def client_headers(self) -> dict[str, str]:
        """What the conductor's routes need."""
        return {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}

    # -- up -------------------------------------------------------------------------------
    def up(self, timeout_s: float = 300.0, progress=print) -> None:
        """Start everything and wait until the conductor reports every instance up."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_pool(progress)
            roles = [("both", self.spec.colocated)] if self.spec.colocated else [
                ("prefill", self.spec.prefill), ("decode", self.spec.decode)]
            for role, count in roles:
                for i in range(count):
                    self._start_instance(f"{role}{i}", role)
            progress(f"loading the model in {sum(c for _, c in roles)} instance(s) ...")
            for p in list(self.procs.values()):
                if p.role in ("prefill", "decode", "both"):
                    self._wait_healthy(p, timeout_s)
                    progress(f"  {p.name} up at {p.url}")
            self._start_conductor()
            self.wait_all_up(timeout_s)
            progress(f"conductor up at {self.conductor_url}")
        except BaseException:
            self.down()
            raise

    def _spawn(self, name: str, role: str, argv: list[str], port: int, url: str) -> Proc:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", CLUSTER_KEY_ENV: self.cluster_key})
        self._popen[name] = popen
        proc = self.procs[name] = Proc(name, role, popen.pid, port, url, str(log), argv)
        return proc

    def _start_pool(self, progress) -> None:
        if self.spec.pool == "none":
            return
        make = redis_service if self.spec.pool == "redis" else mooncake_master_service
        service = make(log_path=self.log_dir / "pool.log")
        service.start()
        assert service.proc is not None
        self._popen["pool"] = service.proc
        scheme = "redis" if self.spec.pool == "redis" else "mooncake"
        self.pool_url = f"{scheme}://127.0.0.1:{service.port}"
        self.procs["pool"] = Proc("pool", "pool", service.proc.pid, service.port, self.pool_url,
                                  str(self.log_dir / "pool.log"), service.argv)
        progress(f"pool: {service.name} at {self.pool_url}")

    def _start_instance(self, name: str, role: str) -> Proc:
        port = free_port()
        argv = _python_cmd("serve", "--port", str(port), "--role", role, *self.spec.instance_args)
        if role == "decode":
            argv += self.spec.decode_args
        if self.pool_url:
            argv += ["--kv-remote", self.pool_url]
        return self._spawn(name, role, argv, port, f"http://127.0.0.1:{port}")

    def _start_conductor(self) -> None:
        port = free_port()
        if self.spec.colocated:
            members = ["--instances", ",".join(self.urls("both"))]
        else:
            members = ["--prefill", ",".join(self.urls("prefill")), "--decode", ",".join(self.urls("decode"))]
        argv = _python_cmd("conductor", "--port", str(port), *members, *self.spec.conductor_args)
        if self.spec.api_key:
            argv += ["--api-key", self.spec.api_key]
        proc = self._spawn("conductor", "conductor", argv, port, f"http://127.0.0.1:{port}")
        self._wait_healthy(proc, 120.0, path="/v1/models")

    def restart(self, name: str, timeout_s: float = 300.0) -> None:
        """Start a stopped instance again with its original command line (same port)."""
        p = self.procs[name]
        self.stop(name)
        self._spawn(name, p.role, p.argv, p.port, p.url)
        self._wait_healthy(self.procs[name], timeout_s)

    def _wait_healthy(self, p: Proc, timeout_s: float, path: str = "/health") -> None:
        deadline = time.monotonic() + timeout_s
        popen = self._popen[p.name]
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                tail = Path(p.log).read_text(errors="replace")[-3000:]
                raise ClusterError(f"{p.name} exited with {popen.returncode}; log {p.log}:\n{tail}")
            try:
                headers = self.client_headers if p.role == "conductor" else {}
                if httpx.get(p.url + path, headers=headers, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ClusterError(f"{p.name} not healthy at {p.url} after {timeout_s}s; log {p.log}")

    def wait_all_up(self, timeout_s: float = 60.0, up: bool = True) -> dict:
        """/cluster once every instance is up (or, with up=False, once any is down)."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = httpx.get(self.conductor_url + "/cluster", headers=self.client_headers, timeout=5.0).json()
            flags = [v["up"] for v in state["instances"].values()]
            if (all(flags) if up else not all(flags)) or time.monotonic() > deadline:
                return state
            time.sleep(0.1)

    # -- down -----------------------------------------------------------------------------
    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        popen = self._popen.get(name)
        if popen is None or popen.poll() is not None:
            return
        popen.send_signal(sig)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()

    def down(self) -> None:
        """Conductor first, then instances, then the pool."""
        order = sorted(self.procs, key=lambda n: {"conductor": 0, "pool": 2}.get(self.procs[n].role, 1))
        for name in order:
            self.stop(name)

    # -- state file -----------------------------------------------------------------------
    def write_state(self, path: Path) -> None:
        """The state file holds the cluster key, so only its owner may read it."""
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(json.dumps({"log_dir": str(self.log_dir), "pool_url": self.pool_url,
                                    "spec": asdict(self.spec), "cluster_key": self.cluster_key,
                                    "procs": [asdict(p) for p in self.procs.values()]}, indent=2))


def stop_from_state(path: Path, progress=print) -> int:
    """Stop every process a state file lists (conductor first), by pid; returns how many."""
    state = json.loads(path.read_text())
    procs = [Proc(**p) for p in state["procs"]]
    procs.sort(key=lambda p: {"conductor": 0, "pool": 2}.get(p.role, 1))
    stopped = 0
    for p in procs:
        if not _is_ours(p):
            continue
        os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(p.pid):
            os.kill(p.pid, signal.SIGKILL)
        progress(f"stopped {p.name} (pid {p.pid})")
        stopped += 1
    path.unlink()
    return stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not reaped by its exited parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _is_ours(p: Proc) -> bool:
    """The pid still runs the command we started (pids are reused)."""
    try:
        cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and cmdline[0].decode(errors="replace") == p.argv[0] and _alive(p.pid)
