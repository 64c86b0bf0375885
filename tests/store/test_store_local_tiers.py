import logging
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import ConfigError
from kvpool.store.disk import MARKER, SUBDIR, DiskTier, file_name
from kvpool.store.host import HostTier


def test_host_evicts_least_recently_used_first():
    host = HostTier(capacity_bytes=300)
    for k in "abc":
        assert host.put(k, b"x" * 100)
    assert host.get("a") is not None  # a is now most recent
    host.put("d", b"x" * 100)
    assert sorted(host.present_keys()) == ["a", "c", "d"]
    assert host.stats().evictions == 1


def test_host_fifo_policy_ignores_access():
    host = HostTier(capacity_bytes=300, policy="fifo")
    for k in "abc":
        host.put(k, b"x" * 100)
    host.get("a")
    host.put("d", b"x" * 100)
    assert sorted(host.present_keys()) == ["b", "c", "d"]


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 120)), max_size=60))
def test_host_never_exceeds_its_byte_budget(ops):
    host = HostTier(capacity_bytes=400)
    for key, size in ops:
        host.put(str(key), b"x" * size)
        s = host.stats()
        assert s.used_bytes <= s.capacity_bytes
        assert s.used_bytes == sum(len(host.get(k) or b"") for k in host.present_keys())


def test_host_refuses_a_block_larger_than_its_capacity():
    host = HostTier(capacity_bytes=50)
    assert not host.put("big", b"x" * 51)
    assert host.stats().failed_puts == 1 and not host.contains("big")


def test_host_hands_evicted_blocks_to_the_demotion_callback(tmp_path):
    host = HostTier(capacity_bytes=200)
    disk = DiskTier(tmp_path, capacity_bytes=10_000)
    host.on_evict = disk.put
    host.put("a", b"A" * 100)
    host.put("b", b"B" * 100)
    host.put("c", b"C" * 100)
    assert not host.contains("a")
    assert disk.get("a") == b"A" * 100


def test_lookup_counts_the_present_prefix_only():
    host = HostTier(capacity_bytes=1000)
    for k in ["k0", "k1", "k3"]:
        host.put(k, b"v")
    assert host.lookup(["k0", "k1", "k2", "k3"]) == 2
    assert host.lookup([]) == 0


def test_capacity_must_be_positive():
    with pytest.raises(ConfigError, match="-1"):
        HostTier(-1)
    with pytest.raises(ConfigError, match="0 bytes"):
        DiskTier("/tmp/unused-kvpool-disk", 0)


def test_disk_round_trip_and_budget(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=250)
    for k in "abc":
        assert disk.put(k, k.encode() * 100)
    assert not disk.contains("a") and disk.get("c") == b"c" * 100
    assert disk.stats().used_bytes == 200
    assert sum(f.stat().st_size for f in (tmp_path / SUBDIR).glob("*.kvb")) == 200


def test_disk_restart_finds_previous_blocks(tmp_path):
    first = DiskTier(tmp_path, capacity_bytes=10_000)
    first.put("kv:ns:00ff", b"hello")
    first.put("kv:ns:0100", b"world")
    again = DiskTier(tmp_path, capacity_bytes=10_000)
    assert again.lookup(["kv:ns:00ff", "kv:ns:0100"]) == 2
    assert again.get("kv:ns:0100") == b"world"
    assert again.stats().used_bytes == 10


def test_disk_restart_evicts_down_to_a_smaller_budget_oldest_first(tmp_path):
    first = DiskTier(tmp_path, capacity_bytes=10_000)
    for i, k in enumerate("abc"):
        first.put(k, b"x" * 100)
        os.utime(tmp_path / SUBDIR / file_name(k), ns=(10**18 + i, 10**18 + i))
    smaller = DiskTier(tmp_path, capacity_bytes=200)
    assert not smaller.contains("a") and smaller.contains("b") and smaller.contains("c")


def test_disk_restart_removes_its_own_interrupted_temp_files_only(tmp_path):
    DiskTier(tmp_path, capacity_bytes=100)
    ours = tmp_path / SUBDIR / f".tmp-{'ab' * 16}.part"
    ours.write_bytes(b"partial")
    (tmp_path / ".tmp-deadbeef").write_bytes(b"a user's file")
    DiskTier(tmp_path, capacity_bytes=100)
    assert not ours.exists() and (tmp_path / ".tmp-deadbeef").read_bytes() == b"a user's file"


def test_disk_file_deleted_behind_our_back_is_a_miss(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=1000)
    disk.put("a", b"data")
    (tmp_path / SUBDIR / file_name("a")).unlink()
    assert disk.get("a") is None
    assert not disk.contains("a") and disk.stats().used_bytes == 0


def test_disk_delete_removes_file(tmp_path, caplog):
    disk = DiskTier(tmp_path, capacity_bytes=1000)
    disk.put("a", b"data")
    disk.delete("a")
    assert [p.name for p in (tmp_path / SUBDIR).iterdir()] == [MARKER]
    with caplog.at_level(logging.INFO):
        DiskTier(tmp_path, capacity_bytes=1000)
    assert "found" not in caplog.text
