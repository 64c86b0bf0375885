"""Layer-wise reads from Redis (issue 32, item 4): GETRANGE reads a block's header, then one layer at
a time, with the checks of a whole read; a value evicted, flipped or replaced between the header and
a layer is a miss or a dropped bad entry, never another block's bytes."""

from __future__ import annotations

import numpy as np
import pytest
import redis
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block, needs_redis

from kvpool.store.format import CorruptBlock, check_head, encode_block
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.layered import LayeredBlock, LayerUnavailable
from kvpool.store.remote_redis import RedisTier
from kvpool.store.tier import RangeReads

pytestmark = needs_redis


@pytest.fixture
def redis_store(redis_server, request):
    """A store of one Redis tier, in a namespace of this test's own."""
    ns = f"{NAMESPACE}|{request.node.name}"
    store = TieredKVStore([RedisTier(f"redis://127.0.0.1:{redis_server.port}/0")], ns, SHAPE, DTYPE)
    yield store, redis.Redis(port=redis_server.port)
    store.close()


def h(i: int) -> bytes:
    return bytes([i]) * 16


def test_redis_reads_ranges(redis_store):
    store, _ = redis_store
    assert isinstance(store.tiers[0], RangeReads)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_redis_block_read_layer_by_layer_equals_the_whole_read(redis_server, codec):
    tier = RedisTier(f"redis://127.0.0.1:{redis_server.port}/0")
    store = TieredKVStore([tier], f"{NAMESPACE}|{codec}", SHAPE, DTYPE, codecs={"redis": codec})
    for i in range(3):
        store.save(h(i), make_block(i))
    layered = store.load([h(i) for i in range(3)], layered=[t.name for t in store.tiers])
    assert len(layered) == 3 and all(isinstance(b, LayeredBlock) for b in layered)
    for i, got in enumerate(layered):
        for layer in range(SHAPE[0]):
            np.testing.assert_array_equal(got[layer], make_block(i)[layer])
        store.finish_layered(got)
    s = store.stats()["redis"]
    assert s.hits == 3 and s.bytes_read == sum(b.nbytes for b in layered)
    assert s.read_bandwidth > 0  # measured for the load planner, as a whole read
    store.close()


def _layer_span(store: TieredKVStore, r: redis.Redis, i: int, layer: int) -> tuple[int, int]:
    data = r.get(store.key(h(i)))
    offset, length, _ = check_head(data, len(data), store.namespace, SHAPE, DTYPE, h(i)).layers[layer]
    return offset, length


def test_a_flipped_layer_on_redis_passes_the_header_and_is_dropped_when_read(redis_store):
    store, r = redis_store
    store.save(h(0), make_block(0))
    offset, length = _layer_span(store, r, 0, 1)
    key = store.key(h(0))
    byte = r.getrange(key, offset + length // 2, offset + length // 2)
    r.setrange(key, offset + length // 2, bytes([byte[0] ^ 0x10]))
    (block,) = store.load([h(0)], layered=[t.name for t in store.tiers])
    np.testing.assert_array_equal(block[0], make_block(0)[0])
    with pytest.raises(CorruptBlock) as err:
        block[1]
    assert err.value.reason == "checksum"
    store.reject_layered(block, err.value)
    assert store.stats()["redis"].bad_entries == {"checksum": 1} and not r.exists(key)


def test_a_value_evicted_after_its_header_is_a_miss(redis_store):
    store, r = redis_store
    store.save(h(0), make_block(0))
    (block,) = store.load([h(0)], layered=[t.name for t in store.tiers])
    r.delete(store.key(h(0)))
    with pytest.raises(LayerUnavailable):
        block[0]


def test_a_value_replaced_by_another_blocks_never_gives_its_bytes(redis_store):
    """Block 1's value (same size and layout) put under block 0's key after block 0's header was
    read: every layer read is refused, including a layer whose bytes pass block 0's table (made so
    here: block 1 shares block 0's layer 0), and nothing of block 1 is served as block 0."""
    store, r = redis_store
    zero = make_block(0)
    one = make_block(1)
    one[0] = zero[0]  # layer 0 identical, so its CRC in block 0's table passes on block 1's value
    store.save(h(0), zero)
    (block,) = store.load([h(0)], layered=[t.name for t in store.tiers])
    key = store.key(h(0))
    replaced = encode_block(store.namespace, h(1), one)
    assert len(replaced) == block.nbytes
    r.set(key, replaced)
    for layer in range(SHAPE[0]):
        with pytest.raises(LayerUnavailable, match="gone"):
            block[layer]
    assert store.load([h(0)]) == []  # a whole read refuses it too (identity)
    assert store.stats()["redis"].bad_entries == {"identity": 1}


def test_a_layer_read_without_its_header_read_first_is_refused(redis_store):
    store, _ = redis_store
    store.save(h(0), make_block(0))
    tier = store.tiers[0]
    assert tier.get_range(store.key(h(0)), 200, 16) is None
    got = tier.get_range(store.key(h(0)), 0, 16)
    assert got is not None and len(got[0]) == 16 and tier.get_range(store.key(h(0)), 200, 16)[1] == got[1]


def test_an_oversized_or_missing_value_is_a_miss_at_the_header(redis_store):
    store, r = redis_store
    tier = store.tiers[0]
    key = store.key(h(0))
    assert tier.get_range(key, 0, 64) is None
    r.set(key, b"x" * (tier.max_value_bytes + 1))
    assert tier.get_range(key, 0, 64) is None and not r.exists(key)
    assert tier.stats().bad_entries == {"size": 1}
    r.rpush(key, b"a list")
    assert tier.get_range(key, 0, 64) is None and not r.exists(key)
    assert tier.stats().bad_entries == {"size": 1, "wrong_type": 1}
