"""Layer-wise reads (store/layered.py): a block's header and table are read and checked first, each
layer when asked for, checked against its own CRC; format 3 needs no change for it."""

from __future__ import annotations

import numpy as np
import pytest
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block

from kvpool.store.disk import SUBDIR, DiskTier, file_name
from kvpool.store.format import CorruptBlock, check_head
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.layered import LayeredBlock, LayerUnavailable

H = [bytes([i]) * 16 for i in range(3)]


def disk_store(tmp_path, codec: str = "none", host: bool = False) -> TieredKVStore:
    tiers = ([HostTier(1 << 20)] if host else []) + [DiskTier(tmp_path, 1 << 20)]
    return TieredKVStore(tiers, NAMESPACE, SHAPE, DTYPE, codecs={"disk": codec})


def flip_layer(tmp_path, store: TieredKVStore, block_hash: bytes, layer: int) -> None:
    path = tmp_path / SUBDIR / file_name(store.key(block_hash))
    data = bytearray(path.read_bytes())
    offset, length, _ = check_head(data, len(data), NAMESPACE, SHAPE, DTYPE, block_hash).layers[layer]
    data[offset + length // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("codec", ["none", "zstd", "int8"])
def test_a_layered_read_gives_each_layer_as_the_whole_read_does(tmp_path, codec):
    store = disk_store(tmp_path, codec)
    blocks = [make_block(i) for i in range(3)]
    for h, b in zip(H, blocks, strict=True):
        store.save(h, b)
    whole = store.load(H)
    layered = store.load(H, layered=[t.name for t in store.tiers])
    assert all(isinstance(b, LayeredBlock) for b in layered)
    for got, want in zip(layered, whole, strict=True):
        for layer in range(SHAPE[0]):
            np.testing.assert_array_equal(got[layer], want[layer])
        assert got[1, 0].shape == SHAPE[2:]  # K of layer 1
    store.close()


def test_a_flipped_layer_passes_the_header_and_fails_when_read(tmp_path):
    store = disk_store(tmp_path)
    store.save(H[0], make_block(0))
    flip_layer(tmp_path, store, H[0], 1)
    (block,) = store.load(H[:1], layered=[t.name for t in store.tiers])  # the header and table are intact
    np.testing.assert_array_equal(block[0], make_block(0)[0])
    with pytest.raises(CorruptBlock) as err:
        block[1]
    assert err.value.reason == "checksum"
    store.reject_layered(block, err.value)
    assert store.stats()["disk"].bad_entries == {"checksum": 1}
    assert H[0] in store.recent_corrupt and store.lookup(H[:1])[0] == 0  # dropped
    store.close()


def test_a_value_gone_since_its_header_is_a_miss_not_a_bad_entry(tmp_path):
    store = disk_store(tmp_path)
    store.save(H[0], make_block(0))
    (block,) = store.load(H[:1], layered=[t.name for t in store.tiers])
    store.tiers[0].delete(store.key(H[0]))
    with pytest.raises(LayerUnavailable):
        block[0]
    store.reject_layered(block, LayerUnavailable("gone"))
    assert store.stats()["disk"].bad_entries == {}
    store.close()


def test_a_bad_header_is_a_miss_read_no_further(tmp_path):
    store = disk_store(tmp_path)
    store.save(H[0], make_block(0))
    store.save(H[1], make_block(1))
    a, b = (tmp_path / SUBDIR / file_name(store.key(h)) for h in H[:2])
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)  # files swapped: each holds the other's block
    b.write_bytes(data_a)
    assert store.load(H[:2], layered=[t.name for t in store.tiers]) == []
    assert store.stats()["disk"].bad_entries == {"identity": 1}
    store.close()


def test_a_block_read_whole_layer_by_layer_is_measured_and_promoted(tmp_path):
    store = disk_store(tmp_path, host=True)
    store.tiers[0].delete(store.key(H[0]))
    store.save(H[0], make_block(0))
    store.tiers[0].delete(store.key(H[0]))  # only the disk holds it
    (block,) = store.load(H[:1], layered=[t.name for t in store.tiers])
    assert block.tier == "disk"
    for layer in range(SHAPE[0]):
        block[layer]
    store.finish_layered(block)
    store.flush()  # the promotion runs on a worker
    assert "disk" in store.read_costs()
    assert store.tiers[0].present_keys() == [store.key(H[0])]
    store.close()
