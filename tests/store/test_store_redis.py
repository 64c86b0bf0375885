import logging
from pathlib import Path

import numpy as np
import pytest
import redis
from store_helpers import (
    DTYPE,
    NAMESPACE,
    SHAPE,
    make_block,
    needs_redis,
    race_put,
    retry_until,
    serve,
)

from kvpool.core.hashing import hash_blocks
from kvpool.store.format import encode_block
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.remote_redis import RedisTier
from kvpool.store.services import redis_service

pytestmark = needs_redis
HASHES = hash_blocks(list(range(40)), block_size=4, namespace="redis-test")


def url(service) -> str:
    return f"redis://127.0.0.1:{service.port}/0"


def test_put_get_lookup_round_trip(redis_server):
    tier = RedisTier(url(redis_server))
    assert tier.put("rt:a", b"alpha") and tier.put("rt:b", b"beta")
    assert tier.get("rt:a") == b"alpha" and tier.get("rt:zz") is None
    assert tier.lookup(["rt:a", "rt:b", "rt:zz", "rt:a"]) == 2
    tier.delete("rt:a")
    assert not tier.contains("rt:a")
    s = tier.stats()
    assert s.hits == 1 and s.misses == 1 and s.bytes_written == 9 and s.used_bytes > 0


def test_concurrent_writers_of_one_block_are_harmless(redis_server):
    writers = [RedisTier(url(redis_server)) for _ in range(4)]
    value = b"v" * 50_000
    results = race_put(writers, "race:k", value)
    assert results == [True] * 4
    assert writers[0].get("race:k") == value
    assert sum(w.stats().bytes_written for w in writers) == len(value)  # NX: one write landed


def test_store_reads_back_through_redis_in_a_fresh_process_view(redis_server):
    first = TieredKVStore([HostTier(10**6), RedisTier(url(redis_server))], NAMESPACE, SHAPE, DTYPE)
    for i, h in enumerate(HASHES[:3]):
        first.save(h, make_block(i))
    other = TieredKVStore([HostTier(10**6), RedisTier(url(redis_server))], NAMESPACE, SHAPE, DTYPE)
    assert other.lookup(HASHES[:4]) == (3, ["redis"] * 3)
    assert np.array_equal(other.load(HASHES[:3])[2], make_block(2))
    assert other.lookup(HASHES[:3]) == (3, ["host"] * 3)


def test_full_redis_refuses_puts_cleanly(tmp_path):
    for service in serve(redis_service(maxmemory="3mb", policy="noeviction",
                                       log_path=Path(tmp_path) / "r.log")):
        tier = RedisTier(url(service))
        results = [tier.put(f"full:{i}", b"x" * 200_000) for i in range(40)]
        assert results[0] and not results[-1]
        assert tier.stats().failed_puts == results.count(False) > 0
        assert not tier.health.down


def test_killed_server_degrades_to_misses_with_one_warning_then_recovers(tmp_path, caplog):
    for service in serve(redis_service(log_path=Path(tmp_path) / "r.log")):
        tier = RedisTier(url(service), timeout_s=0.2, retry_s=0.2)
        assert tier.put("k:1", b"one")
        service.stop()
        with caplog.at_level(logging.WARNING, logger="kvpool.store.health"):
            for _ in range(5):
                assert tier.get("k:1") is None
                assert tier.put("k:2", b"two") is False
                assert tier.lookup(["k:1"]) == 0
        warnings = [r for r in caplog.records if "unreachable" in r.message]
        assert len(warnings) == 1 and tier.stats().errors >= 1
        service.start()
        retry_until(lambda tier=tier: tier.put("k:3", b"three"), attempts=200, pause_s=0.1, what="redis tier")
        assert tier.get("k:3") == b"three" and not tier.health.down


@pytest.mark.parametrize("bad", ["redis://127.0.0.1:1/0"])
def test_unreachable_pool_at_start_is_not_an_error(bad):
    tier = RedisTier(bad, timeout_s=0.2)
    assert tier.lookup(["a"]) == 0 and tier.put("a", b"x") is False and tier.get("a") is None


def redis_store(service) -> tuple[TieredKVStore, RedisTier]:
    tier = RedisTier(url(service))
    return TieredKVStore([tier], NAMESPACE, SHAPE, DTYPE), tier


def test_a_key_of_another_type_is_a_counted_miss_and_is_dropped(redis_server):
    store, tier = redis_store(redis_server)
    hashes = hash_blocks(list(range(1000, 1012)), block_size=4, namespace="redis-wrongtype")
    for i, h in enumerate(hashes):
        store.save(h, make_block(i))
    raw = redis.Redis(port=redis_server.port)
    raw.delete(store.key(hashes[1]))
    raw.rpush(store.key(hashes[1]), b"not a block")  # GET on it is a WRONGTYPE error
    assert store.lookup(hashes) == (3, ["redis"] * 3)
    out = store.load(hashes)
    assert len(out) == 1 and np.array_equal(out[0], make_block(0))
    assert store.stats()["redis"].bad_entries == {"wrong_type": 1}
    assert not raw.exists(store.key(hashes[1]))
    assert not tier.health.down


def test_swapped_values_are_refused_not_served(redis_server):
    store, _ = redis_store(redis_server)
    hashes = hash_blocks(list(range(2000, 2012)), block_size=4, namespace="redis-swap")
    for i, h in enumerate(hashes):
        store.save(h, make_block(i))
    raw = redis.Redis(port=redis_server.port)
    a, b = store.key(hashes[0]), store.key(hashes[2])
    va, vb = raw.get(a), raw.get(b)
    raw.set(a, vb)
    raw.set(b, va)
    assert store.load(hashes) == []
    assert store.stats()["redis"].bad_entries == {"identity": 1}
    assert store.save(hashes[0], make_block(0))
    assert len(store.load(hashes[:2])) == 2


def test_an_oversized_value_is_never_read_whole(redis_server):
    store, tier = redis_store(redis_server)
    (h,) = hash_blocks(list(range(3000, 3004)), block_size=4, namespace="redis-big")
    raw = redis.Redis(port=redis_server.port)
    raw.set(store.key(h), b"x" * (10 * tier.max_value_bytes))
    assert store.load([h]) == []
    assert store.stats()["redis"].bad_entries == {"size": 1}
    assert tier.stats().bytes_read <= tier.max_value_bytes + 1
    assert not raw.exists(store.key(h))


@pytest.mark.parametrize("codec", ["zstd", "zstd-shuffle"])
def test_a_compressed_block_round_trips_and_a_corrupted_one_is_dropped(redis_server, codec):
    tier = RedisTier(url(redis_server))
    store = TieredKVStore([tier], NAMESPACE, SHAPE, DTYPE, codecs={"redis": codec})
    hashes = hash_blocks(list(range(4000, 4008)), block_size=4, namespace=f"redis-{codec}")
    blocks = [np.round(make_block(i).astype(np.float32), 1).astype(DTYPE) for i in range(2)]
    for h, b in zip(hashes, blocks, strict=True):
        store.save(h, b)
    raw = redis.Redis(port=redis_server.port)
    assert len(raw.get(store.key(hashes[0]))) < len(encode_block(NAMESPACE, hashes[0], blocks[0]))  # compressed
    out = store.load(hashes)
    assert all(np.array_equal(o.view(np.uint16), b.view(np.uint16)) for o, b in zip(out, blocks, strict=True))
    value = bytearray(raw.get(store.key(hashes[1])))
    value[-30] ^= 0x04
    raw.set(store.key(hashes[1]), bytes(value))
    assert len(store.load(hashes)) == 1
    assert sum(store.stats()["redis"].bad_entries.values()) == 1
