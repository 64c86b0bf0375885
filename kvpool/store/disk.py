"""Local-disk tier: one file per block in a directory of its own, bounded by a byte budget.

The tier owns only `<path>/kvpool-blocks/`, created 0700 with a marker file; it never reads,
writes or deletes anything outside it, so a user's files in `<path>` are safe, and it refuses
to start on a directory of that name it did not create. Every operation is relative to a
descriptor of that directory opened without following symlinks. Block files are opened with
O_NOFOLLOW | O_NONBLOCK and read only when fstat says they are regular files of the size the
index expects, so a symlink, directory or FIFO at a block path is a counted miss left where it
is (it is not ours to delete), never a stall and never a read outside the tier.

Each block is written (0600) to a temporary file and hard-linked into place: the link is
atomic, so a crash never leaves half a block under a block's name, and it fails if the name
exists, so nothing the tier did not write is ever replaced. The index (key -> size) is
rebuilt by scanning the directory, so a restarted (even SIGKILLed) server keeps its cache;
files are re-inserted oldest-modified first so the eviction order survives approximately,
and temporary files of an interrupted write are removed. With `retention` (set by the store)
eviction honours the device pool's pins, TTLs and priorities (retained.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import threading
import uuid
from pathlib import Path

from kvpool.core.policies import make_policy
from kvpool.errors import ConfigError
from kvpool.store.host import EvictCallback
from kvpool.store.retained import TierRetention, take_victims
from kvpool.store.tier import StoreKey, TierStats

log = logging.getLogger(__name__)

SUBDIR = "kvpool-blocks"
MARKER = "KVPOOL-DISK-TIER"
SUFFIX = ".kvb"
_TMP = re.compile(r"\.tmp-[0-9a-f]{32}\.part")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Reasons an entry at a block path is left in place: the tier did not make it.
_FOREIGN = ("symlink", "not_regular", "unreadable")


def file_name(key: StoreKey) -> str:
    """Hex of the namespaced key: safe on every filesystem and reversible on restart."""
    return key.encode().hex() + SUFFIX


class DiskTier:
    """Blocks as files under `path/kvpool-blocks`, at most `capacity_bytes` of file contents."""

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, policy: str = "lru",
                 name: str = "disk") -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"disk tier capacity must be positive, got {capacity_bytes} bytes")
        self.name = name
        self.path = Path(path) / SUBDIR
        self.on_evict: EvictCallback | None = None
        self.max_value_bytes: int | None = None
        self.retention: TierRetention | None = None
        self._sizes: dict[StoreKey, int] = {}
        self._policy = make_policy(policy)
        self._lock = threading.Lock()
        self._stats = TierStats(name=name, capacity_bytes=capacity_bytes)
        self._dir = _open_own_dir(Path(path))
        self._scan()

    # -- start-up --------------------------------------------------------------------------
    def _scan(self) -> None:
        found: list[tuple[int, StoreKey, int]] = []
        with os.scandir(self._dir) as entries:
            for entry in entries:
                regular = entry.is_file(follow_symlinks=False)
                if _TMP.fullmatch(entry.name):
                    if regular:  # a write interrupted by a crash
                        self._unlink(entry.name)
                    continue
                if not entry.name.endswith(SUFFIX) or not regular:
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)]).decode()
                except ValueError:
                    continue
                st = entry.stat(follow_symlinks=False)
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

    # -- the tier --------------------------------------------------------------------------
    def contains(self, key: StoreKey) -> bool:
        return key in self._sizes

    def lookup(self, keys: list[StoreKey]) -> int:
        for i, key in enumerate(keys):
            if key not in self._sizes:
                return i
        return len(keys)

    def get(self, key: StoreKey) -> bytes | None:
        with self._stats.timed_load():
            size = self._sizes.get(key)
            data, problem = (None, "gone") if size is None else self._read(key, size)
            if data is None:
                if problem != "gone":
                    self._drop(key, problem)
                else:  # evicted meanwhile, or removed behind our back
                    self._forget(key)
                self._stats.misses += 1
                return None
            with self._lock:
                if key in self._policy:
                    self._policy.touch(key)
                self._stats.hits += 1
                self._stats.bytes_read += len(data)
            return data

    def get_range(self, key: StoreKey, offset: int, length: int) -> tuple[bytes, int] | None:
        """Part of a block file (tier.RangeReads), with the checks of `get`; a read from offset
        0 counts as the hit (and refreshes the block in the eviction order)."""
        size = self._sizes.get(key)
        data, problem = (None, "gone") if size is None else self._read(key, size, offset, length)
        if data is None:
            if problem != "gone":
                self._drop(key, problem)
            else:
                self._forget(key)
            if offset == 0:
                self._stats.misses += 1
            return None
        with self._lock:
            if offset == 0:
                if key in self._policy:
                    self._policy.touch(key)
                self._stats.hits += 1
            self._stats.bytes_read += len(data)
        return data, size

    def put(self, key: StoreKey, data: bytes) -> bool:
        with self._stats.timed_store():
            if key in self._sizes:
                return True
            if len(data) > self._stats.capacity_bytes:
                self._stats.failed_puts += 1
                return False
            tmp = f".tmp-{uuid.uuid4().hex}.part"
            try:
                fd = os.open(tmp, _WRITE_FLAGS, 0o600, dir_fd=self._dir)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            except OSError as exc:
                self._unlink(tmp)
                log.warning("disk tier %s: cannot write a block in %s: %s", self.name, self.path, exc)
                self._stats.failed_puts += 1
                self._stats.errors += 1
                return False
            with self._lock:
                try:
                    if key in self._sizes:
                        return True
                    evicted = self._make_room(len(data))
                    os.link(tmp, file_name(key), src_dir_fd=self._dir, dst_dir_fd=self._dir,
                            follow_symlinks=False)
                except OSError as exc:
                    # EEXIST: something the tier did not write holds the name; leave it alone
                    if exc.errno != errno.EEXIST:
                        log.warning("disk tier %s: cannot store a block in %s: %s", self.name, self.path, exc)
                        self._stats.errors += 1
                    self._stats.failed_puts += 1
                    return False
                finally:
                    self._unlink(tmp)
                self._sizes[key] = len(data)
                self._policy.insert(key)
                self._stats.used_bytes += len(data)
                self._stats.bytes_written += len(data)
                self._stats.puts += 1
        self._demote(evicted)
        return True

    def delete(self, key: StoreKey) -> None:
        with self._lock:
            self._unlink(file_name(key))
        self._forget(key)

    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        """Every block is already a complete file; release the directory descriptor."""
        with self._lock:
            if self._dir >= 0:
                os.close(self._dir)
                self._dir = -1

    # -- files -----------------------------------------------------------------------------
    def _read(self, key: StoreKey, size: int, offset: int = 0, length: int | None = None) -> tuple[bytes | None, str]:
        """The file's bytes (`length` of them from `offset`; all by default), or None and why not
        (`gone`, or a bad-entry reason)."""
        if self.max_value_bytes is not None and size > self.max_value_bytes:
            return None, "size"
        try:
            fd = os.open(file_name(key), _READ_FLAGS, dir_fd=self._dir)
        except FileNotFoundError:
            return None, "gone"
        except OSError as exc:
            return None, "symlink" if exc.errno == errno.ELOOP else "unreadable"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, "not_regular"
            if st.st_size != size:
                return None, "size"
            if length is not None:
                return _pread(fd, offset, min(length, max(0, size - offset))), ""
            chunks, left = [], size + 1  # one byte more than expected: a file that grew is bad too
            while left > 0 and (chunk := os.read(fd, left)):
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
            return (data, "") if len(data) == size else (None, "size")
        except OSError:
            return None, "unreadable"
        finally:
            os.close(fd)

    def _unlink(self, name: str) -> None:
        """Remove `name` if it is a regular file (the only kind the tier makes)."""
        try:
            if stat.S_ISREG(os.stat(name, dir_fd=self._dir, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=self._dir)
        except FileNotFoundError:
            pass

    def _drop(self, key: StoreKey, reason: str) -> None:
        """Count a bad entry and forget it; delete it only if it is a file the tier wrote."""
        log.warning("disk tier %s: bad entry at a block path in %s (%s); treating it as a miss",
                    self.name, self.path, reason)
        with self._lock:
            self._stats.count_bad(reason)
            if reason not in _FOREIGN:
                self._unlink(file_name(key))
        self._forget(key)

    def _make_room(self, size: int) -> list[tuple[StoreKey, bytes]]:
        """Evict until `size` more bytes fit; caller holds the lock."""
        evicted: list[tuple[StoreKey, bytes]] = []
        over = self._stats.used_bytes + size - self._stats.capacity_bytes
        retained = None if over <= 0 or self.retention is None else self.retention.lookup()
        victims, forced = take_victims(self._policy, over, self._sizes.__getitem__, retained)
        self._stats.pinned_evictions += forced
        for victim in victims:
            victim_size = self._sizes.pop(victim)
            if self.on_evict is not None:
                data, _ = self._read(victim, victim_size)
                if data is not None:
                    evicted.append((victim, data))
            self._unlink(file_name(victim))
            self._stats.used_bytes -= victim_size
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


def _pread(fd: int, offset: int, length: int) -> bytes:
    """`length` bytes at `offset` (fewer only if the file shrank meanwhile)."""
    chunks = []
    while length > 0 and (chunk := os.pread(fd, length, offset)):
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)


def _open_own_dir(root: Path) -> int:
    """A descriptor of `root/SUBDIR`, created 0700 with a marker if absent; ConfigError naming
    the path when `root` is not a directory or SUBDIR is not one this tier made."""
    own = root / SUBDIR
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError as exc:
        raise ConfigError(f"disk tier path {str(root)!r} exists and is not a directory") from exc
    except OSError as exc:
        raise ConfigError(f"disk tier path {str(root)!r} cannot be created: {exc.strerror}") from exc
    if not root.is_dir():  # e.g. a dangling symlink
        raise ConfigError(f"disk tier path {str(root)!r} is not a directory")
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's path
    except OSError as exc:
        raise ConfigError(f"disk tier path {str(root)!r} cannot be opened: {exc.strerror}") from exc
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(SUBDIR, 0o700, dir_fd=root_fd)
        try:
            fd = os.open(SUBDIR, _DIR_FLAGS, dir_fd=root_fd)
        except OSError as exc:
            raise ConfigError(f"{str(own)!r} is not a directory (a symlink or a file); the disk tier "
                              "keeps its blocks there: remove it or choose another path") from exc
    finally:
        os.close(root_fd)
    try:
        _claim(fd, own)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _claim(fd: int, own: Path) -> None:
    """Check (or, in a fresh empty directory, write) the marker; make the directory private."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{str(own)!r} belongs to uid {st.st_uid}, not this process's; refusing to use it")
    try:
        marker = os.stat(MARKER, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        if os.listdir(fd):
            raise ConfigError(f"{str(own)!r} exists but was not made by a kvpool disk tier (no {MARKER} "
                              "file); refusing to touch it: remove it or choose another path") from None
        mfd = os.open(MARKER, _WRITE_FLAGS, 0o600, dir_fd=fd)
        with os.fdopen(mfd, "w") as f:
            f.write("kvpool disk tier: KV blocks, one file each; safe to delete while no server runs\n")
    else:
        if not stat.S_ISREG(marker.st_mode):
            raise ConfigError(f"{str(own)!r}: {MARKER} is not a regular file; refusing to use the directory")
    os.fchmod(fd, 0o700)
    probe = f".tmp-{uuid.uuid4().hex}.part"
    try:  # blocks are published by hard link (it never replaces an entry); check it works here
        os.link(MARKER, probe, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
    except OSError as exc:
        raise ConfigError(f"the filesystem of {str(own)!r} does not support hard links ({exc.strerror}); "
                          "the disk tier needs them") from exc
    os.unlink(probe, dir_fd=fd)
