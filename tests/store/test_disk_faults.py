"""#31 item 8, the disk tier's fault paths the safety tests do not reach: its directory deleted
under a running tier, and a full filesystem (a small tmpfs, when this process may mount one).
(FIFOs, symlinks and SIGKILL during writes: test_store_disk_safety.py.)"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block

from kvpool.core.hashing import hash_blocks
from kvpool.store.disk import SUBDIR, DiskTier
from kvpool.store.kv_store import TieredKVStore

HASHES = hash_blocks(list(range(4000)), block_size=4, namespace="disk-faults")


def disk_store(path: Path, capacity: int = 10**8) -> tuple[TieredKVStore, DiskTier]:
    disk = DiskTier(path, capacity)
    return TieredKVStore([disk], NAMESPACE, SHAPE, DTYPE), disk


def test_a_deleted_tier_directory_turns_into_misses_and_failed_puts_not_errors(tmp_path):
    store, disk = disk_store(tmp_path / "tier")
    for i in range(4):
        assert store.save(HASHES[i], make_block(i))
    shutil.rmtree(tmp_path / "tier")
    assert not store.save(HASHES[10], make_block(10))  # nowhere to write: refused, counted
    for h in HASHES[:4]:
        assert store.load([h]) == []  # every block is gone: misses, not exceptions
    stats = store.stats()["disk"]
    assert stats.failed_puts == 1 and stats.misses == 4 and stats.used_bytes == 0
    assert store.lookup(HASHES[:4])[0] == 0  # and forgotten: no later lookup promises them
    fresh, _ = disk_store(tmp_path / "tier")  # a restart makes the directory again and works
    assert fresh.save(HASHES[0], make_block(0))
    assert np.array_equal(fresh.load(HASHES[:1])[0], make_block(0))


@pytest.fixture
def tiny_fs(tmp_path) -> Iterator[Path]:
    """A 64 KiB tmpfs at tmp_path/fs (needs root and mount(8); skipped otherwise)."""
    mount = shutil.which("mount")
    target = tmp_path / "fs"
    target.mkdir()
    if mount is None:
        pytest.skip("no mount(8) on this machine to make a small filesystem")
    made = subprocess.run([mount, "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(target)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip() or made.returncode}): needs root")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_full_filesystem_refuses_puts_keeps_every_stored_block_and_leaves_no_partial_file(tiny_fs):
    store, disk = disk_store(tiny_fs, capacity=10**8)  # the budget is far above what the filesystem holds
    size = make_block(0).nbytes
    saved = []
    for i in range(2 * (64 * 1024) // size + 4):  # twice what fits, at least
        if store.save(HASHES[i], make_block(i)):
            saved.append(i)
    stats = store.stats()["disk"]
    assert saved and stats.failed_puts > 0 and stats.errors > 0
    assert saved == list(range(len(saved)))  # it filled up, then refused; nothing stored was lost
    out = store.load([HASHES[i] for i in saved])
    assert len(out) == len(saved) and all(np.array_equal(b, make_block(i)) for i, b in zip(saved, out, strict=True))
    assert not list((tiny_fs / SUBDIR).glob(".tmp-*")), "a partial write was left behind"
    assert stats.used_bytes == sum((tiny_fs / SUBDIR / p.name).stat().st_size
                                   for p in (tiny_fs / SUBDIR).glob("*.kvb"))
