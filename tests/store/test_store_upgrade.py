"""Format 3 (per-layer checksums) over a tier written by format 2: old blocks are never served,
never break a load, and leave the disk tier's budget as cold blocks."""

import numpy as np
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block, version_2_block

from kvpool.core.hashing import hash_blocks
from kvpool.store.disk import DiskTier
from kvpool.store.format import encode_block
from kvpool.store.kv_store import TieredKVStore

HASHES = hash_blocks(list(range(4 * 8)), block_size=4, namespace="upgrade")


def test_a_version_2_value_under_a_current_key_is_a_miss_and_dropped(tmp_path):
    disk = DiskTier(str(tmp_path), 1 << 24)
    store = TieredKVStore([disk], NAMESPACE, SHAPE, DTYPE)
    disk.put(store.key(HASHES[0]), version_2_block(make_block(0), HASHES[0]))
    assert store.load(HASHES[:1]) == []
    assert store.stats()["disk"].bad_entries == {"version": 1}
    assert not disk.contains(store.key(HASHES[0]))
    assert store.save(HASHES[0], make_block(0)) and np.array_equal(store.load(HASHES[:1])[0], make_block(0))
    store.close()


def test_version_2_blocks_on_disk_are_never_looked_up_and_make_room_when_evicted(tmp_path):
    size = len(encode_block(NAMESPACE, HASHES[0], make_block(0)))
    old = DiskTier(str(tmp_path), 4 * size)
    old_keys = [f"kv2:0123456789abcdef:{h.hex()}" for h in HASHES[:2]]  # what a format-2 server wrote
    for key, h in zip(old_keys, HASHES, strict=False):
        assert old.put(key, version_2_block(make_block(0), h))
    old.close()
    store = TieredKVStore([DiskTier(str(tmp_path), 4 * size)], NAMESPACE, SHAPE, DTYPE)  # restarted, upgraded
    assert store.lookup(HASHES[:2])[0] == 0
    for i, h in enumerate(HASHES[:4]):
        assert store.save(h, make_block(i))
    disk = store.tiers[0]
    assert not any(disk.contains(k) for k in old_keys)  # the cold old blocks went first
    assert [np.array_equal(b, make_block(i)) for i, b in enumerate(store.load(HASHES[:4]))] == [True] * 4
    store.close()
