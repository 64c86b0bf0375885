"""Local-disk tier: one file per block in a directory, bounded by a byte budget.

Each block is written to a temporary file and renamed into place (os.replace is atomic),
so a crash never leaves half a block under a block's name. The index (key -> size) is
rebuilt by scanning the directory, so a restarted server keeps its cache; files are
re-inserted oldest-modified first so the eviction order survives approximately.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from pathlib import Path

from kvpool.core.policies import make_policy
from kvpool.errors import ConfigError
from kvpool.store.host import EvictCallback
from kvpool.store.tier import StoreKey, TierStats

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
_TMP_PREFIX = ".tmp-"


def file_name(key: StoreKey) -> str:
    """Hex of the namespaced key: safe on every filesystem and reversible on restart."""
    return key.encode().hex() + SUFFIX


class DiskTier:
    """Blocks as files under `path`, at most `capacity_bytes` of file contents."""

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, policy: str = "lru",
                 name: str = "disk") -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"disk tier capacity must be positive, got {capacity_bytes} bytes")
        self.name = name
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.on_evict: EvictCallback | None = None
        self._sizes: dict[StoreKey, int] = {}
        self._policy = make_policy(policy)
        self._lock = threading.Lock()
        self._stats = TierStats(name=name, capacity_bytes=capacity_bytes)
        self._scan()

    def _scan(self) -> None:
        found: list[tuple[int, StoreKey, int]] = []
        with os.scandir(self.path) as entries:
            for entry in entries:
                if entry.name.startswith(_TMP_PREFIX):
                    Path(entry.path).unlink(missing_ok=True)  # a write interrupted by a crash
                    continue
                if not entry.name.endswith(SUFFIX) or not entry.is_file():
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)]).decode()
                except ValueError:
                    continue
                st = entry.stat()
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self._policy.insert(key)
            self._stats.used_bytes += size
        with self._lock:
            evicted = self._make_room(0)
        if found:
            log.info("disk tier %s: found %d blocks (%d bytes) in %s", self.name, len(found),
                     self._stats.used_bytes, self.path)
        self._demote(evicted)

    def _file(self, key: StoreKey) -> Path:
        return self.path / file_name(key)

    def contains(self, key: StoreKey) -> bool:
        return key in self._sizes

    def lookup(self, keys: list[StoreKey]) -> int:
        for i, key in enumerate(keys):
            if key not in self._sizes:
                return i
        return len(keys)

    def get(self, key: StoreKey) -> bytes | None:
        with self._stats.timed_load():
            if key not in self._sizes:
                self._stats.misses += 1
                return None
            try:
                data = self._file(key).read_bytes()
            except FileNotFoundError:  # evicted meanwhile, or removed behind our back
                self._forget(key)
                self._stats.misses += 1
                return None
            with self._lock:
                if key in self._policy:
                    self._policy.touch(key)
                self._stats.hits += 1
                self._stats.bytes_read += len(data)
            return data

    def put(self, key: StoreKey, data: bytes) -> bool:
        with self._stats.timed_store():
            if key in self._sizes:
                return True
            if len(data) > self._stats.capacity_bytes:
                self._stats.failed_puts += 1
                return False
            tmp = self.path / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
            try:
                tmp.write_bytes(data)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                log.warning("disk tier %s: cannot write %s: %s", self.name, tmp, exc)
                self._stats.failed_puts += 1
                self._stats.errors += 1
                return False
            with self._lock:
                if key in self._sizes:
                    tmp.unlink(missing_ok=True)
                    return True
                evicted = self._make_room(len(data))
                os.replace(tmp, self._file(key))
                self._sizes[key] = len(data)
                self._policy.insert(key)
                self._stats.used_bytes += len(data)
                self._stats.bytes_written += len(data)
                self._stats.puts += 1
        self._demote(evicted)
        return True

    def _make_room(self, size: int) -> list[tuple[StoreKey, bytes]]:
        """Evict until `size` more bytes fit; caller holds the lock."""
        evicted: list[tuple[StoreKey, bytes]] = []
        while self._sizes and self._stats.used_bytes + size > self._stats.capacity_bytes:
            victim = self._policy.pop_victim()
            path = self._file(victim)
            if self.on_evict is not None:
                with contextlib.suppress(FileNotFoundError):
                    evicted.append((victim, path.read_bytes()))
            path.unlink(missing_ok=True)
            self._stats.used_bytes -= self._sizes.pop(victim)
            self._stats.evictions += 1
        return evicted

    def _demote(self, evicted: list[tuple[StoreKey, bytes]]) -> None:
        if self.on_evict is not None:
            for key, data in evicted:
                self.on_evict(key, data)

    def _forget(self, key: StoreKey) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._policy.remove(key)
                self._stats.used_bytes -= size

    def delete(self, key: StoreKey) -> None:
        with self._lock:
            self._file(key).unlink(missing_ok=True)
        self._forget(key)

    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        """Nothing to release: every block is already a complete file."""
