import logging

import numpy as np
import pytest
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block

from kvpool.core.hashing import hash_blocks
from kvpool.errors import ConfigError
from kvpool.store.codec import CODECS
from kvpool.store.disk import SUBDIR, DiskTier, file_name
from kvpool.store.factory import make_store
from kvpool.store.format import block_codec_id, encode_block
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore

HASHES = hash_blocks(list(range(40)), block_size=4, namespace="test")
BLOCK_BYTES = len(encode_block(NAMESPACE, HASHES[0], make_block(0)))


def store_with(tmp_path, host_blocks=100, disk_blocks=100, policy="write-through"):
    host = HostTier(host_blocks * BLOCK_BYTES)
    disk = DiskTier(tmp_path, disk_blocks * BLOCK_BYTES)
    return TieredKVStore([host, disk], NAMESPACE, SHAPE, DTYPE, policy), host, disk


def test_save_then_load_returns_the_same_blocks(tmp_path):
    store, _, _ = store_with(tmp_path)
    blocks = [make_block(i) for i in range(3)]
    for h, b in zip(HASHES, blocks, strict=False):
        assert store.save(h, b)
    out = store.load(HASHES[:3])
    assert all(np.array_equal(a, b) for a, b in zip(out, blocks, strict=True))


def test_lookup_returns_longest_contiguous_run_across_tiers(tmp_path):
    store, host, disk = store_with(tmp_path)
    for tier, i in [(host, 0), (disk, 1), (disk, 2), (host, 3), (host, 5)]:  # a gap at 4
        tier.put(store.key(HASHES[i]), encode_block(NAMESPACE, HASHES[i], make_block(i)))
    assert store.lookup(HASHES[:6]) == (4, ["host", "disk", "disk", "host"])
    assert store.lookup(HASHES[4:6]) == (0, [])


def test_load_stops_at_first_missing_block(tmp_path):
    store, _, _ = store_with(tmp_path)
    store.save(HASHES[0], make_block(0))
    store.save(HASHES[2], make_block(2))
    assert len(store.load(HASHES[:3])) == 1


def test_disk_hit_is_promoted_into_host(tmp_path):
    store, host, disk = store_with(tmp_path)
    disk.put(store.key(HASHES[0]), encode_block(NAMESPACE, HASHES[0], make_block(0)))
    assert store.lookup(HASHES[:1]) == (1, ["disk"])
    store.load(HASHES[:1])
    assert store.lookup(HASHES[:1]) == (1, ["host"])


def test_write_through_writes_every_tier(tmp_path):
    store, host, disk = store_with(tmp_path)
    store.save(HASHES[0], make_block(0))
    assert host.contains(store.key(HASHES[0])) and disk.contains(store.key(HASHES[0]))


def test_write_back_writes_host_only_and_demotes_on_eviction(tmp_path):
    store, host, disk = store_with(tmp_path, host_blocks=2, policy="write-back")
    for i in range(3):
        store.save(HASHES[i], make_block(i))
    assert not disk.contains(store.key(HASHES[1])) and not disk.contains(store.key(HASHES[2]))
    assert disk.contains(store.key(HASHES[0])) and not host.contains(store.key(HASHES[0]))
    assert store.lookup(HASHES[:3]) == (3, ["disk", "host", "host"])
    assert np.array_equal(store.load(HASHES[:1])[0], make_block(0))


def test_full_tier_fails_the_put_cleanly_and_counts_it(tmp_path):
    host = HostTier(BLOCK_BYTES - 1)
    store = TieredKVStore([host], NAMESPACE, SHAPE, DTYPE)
    assert store.save(HASHES[0], make_block(0)) is False
    assert store.stats()["host"].failed_puts == 1
    assert store.lookup(HASHES[:1]) == (0, [])


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "namespace", "shape", "identity", "version"])
def test_unreadable_disk_block_is_a_miss_deleted_counted_and_logged(tmp_path, caplog, damage):
    store, host, disk = store_with(tmp_path)
    key = store.key(HASHES[0])
    good = encode_block(NAMESPACE, HASHES[0], make_block(0))
    old = bytearray(good)
    old[4:6] = (1).to_bytes(2, "little")
    bad = {
        "truncate": good[: len(good) // 2],
        "bitflip": good[:-1] + bytes([good[-1] ^ 1]),
        "namespace": encode_block("another-model", HASHES[0], make_block(0)),
        "shape": encode_block(NAMESPACE, HASHES[0], make_block(0).reshape(4, 1, 4, 2, 8)),
        "identity": encode_block(NAMESPACE, HASHES[1], make_block(1)),  # another block's value
        "version": bytes(old),
    }[damage]
    disk.put(key, good)
    path = tmp_path / SUBDIR / file_name(key)
    path.write_bytes(bad)
    store, host, disk = store_with(tmp_path)  # a restarted server indexes the file as it is
    with caplog.at_level(logging.WARNING, logger="kvpool.store.kv_store"):
        assert store.load(HASHES[:1]) == []
    assert not disk.contains(key) and not path.exists()
    assert sum(store.stats()["disk"].bad_entries.values()) == 1
    assert len([r for r in caplog.records if "unreadable" in r.message]) == 1
    assert store.load(HASHES[:1]) == []  # second read: a plain miss, no new log line
    assert len([r for r in caplog.records if "unreadable" in r.message]) == 1


def test_a_block_file_resized_under_a_running_tier_is_a_counted_miss(tmp_path):
    store, host, disk = store_with(tmp_path)
    store.save(HASHES[0], make_block(0))
    host.delete(store.key(HASHES[0]))
    path = tmp_path / SUBDIR / file_name(store.key(HASHES[0]))
    path.write_bytes(path.read_bytes() + b"more")
    assert store.load(HASHES[:1]) == []
    assert store.stats()["disk"].bad_entries == {"size": 1} and not path.exists()


def test_swapped_block_files_are_refused_and_recomputable(tmp_path):
    store = TieredKVStore([DiskTier(tmp_path, 100 * BLOCK_BYTES)], NAMESPACE, SHAPE, DTYPE)
    for i in range(2):
        store.save(HASHES[i], make_block(i))
    a, b = (tmp_path / SUBDIR / file_name(store.key(h)) for h in HASHES[:2])
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    assert store.load(HASHES[:2]) == []
    assert store.stats()["disk"].bad_entries == {"identity": 1}
    assert store.save(HASHES[0], make_block(0))  # the dropped block can be stored again
    assert np.array_equal(store.load(HASHES[:1])[0], make_block(0))


def test_corrupt_host_copy_falls_back_to_the_disk_copy(tmp_path):
    store, host, disk = store_with(tmp_path)
    store.save(HASHES[0], make_block(0))
    host.delete(store.key(HASHES[0]))
    host.put(store.key(HASHES[0]), b"garbage")
    out = store.load(HASHES[:1])
    assert len(out) == 1 and np.array_equal(out[0], make_block(0))


def test_async_save_and_load_complete_and_copy_the_input(tmp_path):
    store, _, _ = store_with(tmp_path)
    block = make_block(0)
    futures = [store.save_async(HASHES[0], block)]
    block[...] = 0  # the caller reuses its buffer at once
    futures += [store.save_async(h, make_block(i)) for i, h in enumerate(HASHES[1:8], start=1)]
    assert all(f.result(timeout=30) for f in futures)
    out = store.load_async(HASHES[:8]).result(timeout=30)
    assert np.array_equal(out[0], make_block(0)) and len(out) == 8
    store.close()


def test_save_rejects_a_block_of_the_wrong_layout(tmp_path):
    store, _, _ = store_with(tmp_path)
    with pytest.raises(ConfigError, match="float32"):
        store.save(HASHES[0], make_block(0).astype(np.float32))


def test_store_rejects_unknown_write_policy(tmp_path):
    with pytest.raises(ConfigError, match="write-around"):
        TieredKVStore([HostTier(10)], NAMESPACE, SHAPE, DTYPE, "write-around")


def test_make_store_builds_the_configured_tiers(tmp_path):
    store = make_store("1MiB", str(tmp_path), "4MiB", None, "write-back", NAMESPACE, SHAPE, DTYPE)
    assert [t.name for t in store.tiers] == ["host", "disk"]
    assert store.stats()["disk"].capacity_bytes == 4 * 2**20
    assert make_store(0, None, 0, None, "write-through", NAMESPACE, SHAPE, DTYPE) is None
    with pytest.raises(ConfigError, match="ftp://x"):
        make_store(0, None, 0, "ftp://x", "write-through", NAMESPACE, SHAPE, DTYPE)


def smooth_block(seed: int) -> np.ndarray:
    return np.round(make_block(seed).astype(np.float32), 1).astype(DTYPE)


def test_a_reader_decodes_the_codec_each_block_was_written_with(tmp_path):
    writer = TieredKVStore([DiskTier(tmp_path, 10**6)], NAMESPACE, SHAPE, DTYPE, codecs={"disk": "zstd-shuffle"})
    writer.save(HASHES[0], smooth_block(0))
    path = tmp_path / SUBDIR / file_name(writer.key(HASHES[0]))
    assert block_codec_id(path.read_bytes()) == CODECS["zstd-shuffle"].id
    reader = TieredKVStore([DiskTier(tmp_path, 10**6)], NAMESPACE, SHAPE, DTYPE)  # configured: none
    (out,) = reader.load(HASHES[:1])
    assert np.array_equal(out.view(np.uint16), smooth_block(0).view(np.uint16))


def test_blocks_are_repacked_for_each_tiers_codec_when_they_move(tmp_path):
    host = HostTier(2 * BLOCK_BYTES)
    disk = DiskTier(tmp_path, 100 * BLOCK_BYTES)
    store = TieredKVStore([host, disk], NAMESPACE, SHAPE, DTYPE, "write-back", codecs={"disk": "zstd"})
    for i in range(3):
        store.save(HASHES[i], smooth_block(i))
    key = store.key(HASHES[0])  # demoted from host (raw) to disk (zstd)
    assert block_codec_id(disk.get(key)) == CODECS["zstd"].id
    (out,) = store.load(HASHES[:1])  # promoted from disk back to host, raw again
    assert np.array_equal(out.view(np.uint16), smooth_block(0).view(np.uint16))
    assert block_codec_id(host.get(key)) == CODECS["none"].id


def test_codec_config_is_checked_by_name(tmp_path):
    with pytest.raises(ConfigError, match="'brotli'"):
        make_store(0, str(tmp_path), "1MiB", None, "write-through", NAMESPACE, SHAPE, DTYPE, disk_codec="brotli")
    with pytest.raises(ConfigError, match="'tape'"):
        TieredKVStore([HostTier(10)], NAMESPACE, SHAPE, DTYPE, codecs={"tape": "zstd"})


def test_a_tier_that_raises_is_a_miss_and_an_error_not_an_exception(tmp_path):
    class Broken(HostTier):
        def get(self, key):
            raise RuntimeError("native client fell over")

    broken = Broken(10 * BLOCK_BYTES, name="broken")
    store = TieredKVStore([broken, DiskTier(tmp_path, 10 * BLOCK_BYTES)], NAMESPACE, SHAPE, DTYPE)
    store.save(HASHES[0], make_block(0))
    (out,) = store.load(HASHES[:1])  # served by the disk tier below
    assert np.array_equal(out, make_block(0))
    assert store.stats()["broken"].errors == 1
