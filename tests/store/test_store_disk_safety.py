"""The disk tier keeps to its own directory: it never deletes, follows or blocks on an entry it
did not make, and refuses paths it cannot own with an error that names them."""

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block

from kvpool.core.hashing import hash_blocks
from kvpool.errors import ConfigError
from kvpool.store.disk import MARKER, SUBDIR, DiskTier, file_name
from kvpool.store.factory import make_store
from kvpool.store.kv_store import TieredKVStore

HASHES = hash_blocks(list(range(400)), block_size=4, namespace="disk-safety")
ROOT = Path(__file__).resolve().parents[2]


def disk_store(path, capacity=10**7):
    disk = DiskTier(path, capacity)
    return TieredKVStore([disk], NAMESPACE, SHAPE, DTYPE), disk


def block_path(path, store, i) -> Path:
    return Path(path) / SUBDIR / file_name(store.key(HASHES[i]))


def test_user_files_in_the_disk_path_are_never_touched(tmp_path):
    user = {".tmp-deadbeef": b"draft", "notes.kvb": b"mine", "6b763a.kvb": b"hex-named"}
    for name, data in user.items():
        (tmp_path / name).write_bytes(data)
    store, disk = disk_store(tmp_path)
    store.save(HASHES[0], make_block(0))
    disk_store(tmp_path)  # a restart scans only its own directory
    assert {n: (tmp_path / n).read_bytes() for n in user} == user
    assert disk.stats().used_bytes == block_path(tmp_path, store, 0).stat().st_size


def test_files_are_private_to_the_server(tmp_path):
    store, _ = disk_store(tmp_path)
    store.save(HASHES[0], make_block(0))
    own = tmp_path / SUBDIR
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
    assert stat.S_IMODE(block_path(tmp_path, store, 0).stat().st_mode) == 0o600
    assert stat.S_IMODE((own / MARKER).stat().st_mode) == 0o600


def test_a_regular_file_as_the_disk_path_is_a_config_error_naming_it(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_bytes(b"x")
    with pytest.raises(ConfigError, match="not-a-dir.*not a directory"):
        DiskTier(path, 1000)
    with pytest.raises(ConfigError, match="not-a-dir"):
        make_store(0, str(path), "1MiB", None, "write-through", NAMESPACE, SHAPE, DTYPE)
    assert path.read_bytes() == b"x"


def test_a_symlinked_or_foreign_block_directory_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / SUBDIR).symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="symlink"):
        DiskTier(tmp_path / "a", 1000)
    (tmp_path / "b" / SUBDIR).mkdir(parents=True)
    (tmp_path / "b" / SUBDIR / "data.bin").write_bytes(b"someone's")
    with pytest.raises(ConfigError, match="not made by a kvpool disk tier"):
        DiskTier(tmp_path / "b", 1000)
    assert (tmp_path / "b" / SUBDIR / "data.bin").read_bytes() == b"someone's"


@pytest.mark.timeout(60)  # a FIFO read would block forever: fail, not hang, if it does
@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_a_non_regular_entry_at_a_block_path_is_a_counted_miss_left_in_place(tmp_path, kind):
    store, disk = disk_store(tmp_path)
    for i in range(3):
        store.save(HASHES[i], make_block(i))
    target = block_path(tmp_path, store, 1)
    target.unlink()
    secret = tmp_path / "secret"
    secret.write_bytes(block_path(tmp_path, store, 0).read_bytes())  # a valid block, outside the tier
    {"symlink": lambda: target.symlink_to(secret), "directory": target.mkdir,
     "fifo": lambda: os.mkfifo(target)}[kind]()
    out = store.load(HASHES[:3])  # a FIFO opened for reading would block here without O_NONBLOCK
    assert len(out) == 1 and np.array_equal(out[0], make_block(0))
    reason = "symlink" if kind == "symlink" else "not_regular"
    assert store.stats()["disk"].bad_entries == {reason: 1}
    assert target.is_symlink() if kind == "symlink" else target.exists()
    assert not store.save(HASHES[1], make_block(1))  # never replaced: the name is not the tier's
    assert target.is_symlink() or target.is_dir() or stat.S_ISFIFO(target.lstat().st_mode)
    assert len(store.load(HASHES[:3])) == 1 and store.stats()["disk"].bad_entries == {reason: 1}


def test_sigkill_during_writes_then_restart_serves_every_complete_block(tmp_path):
    script = (
        "import sys\n"
        "from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block\n"
        "from kvpool.core.hashing import hash_blocks\n"
        "from kvpool.store.disk import DiskTier\n"
        "from kvpool.store.kv_store import TieredKVStore\n"
        "hashes = hash_blocks(list(range(400)), block_size=4, namespace='disk-safety')\n"
        f"store = TieredKVStore([DiskTier({str(tmp_path)!r}, 10**7)], NAMESPACE, SHAPE, DTYPE)\n"
        "for i, h in enumerate(hashes):\n"
        "    store.save(h, make_block(i)); print(i, flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "store")]))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        for line in proc.stdout:
            if int(line) >= 20:
                break
        proc.send_signal(signal.SIGKILL)  # mid-write, most likely
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    store, disk = disk_store(tmp_path)
    n, _ = store.lookup(HASHES)
    assert n >= 21
    out = store.load(HASHES[:n])
    assert len(out) == n and all(np.array_equal(b, make_block(i)) for i, b in enumerate(out))
    assert not list((tmp_path / SUBDIR).glob(".tmp-*"))
    assert store.stats()["disk"].bad_entries == {}
