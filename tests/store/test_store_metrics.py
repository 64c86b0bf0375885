"""Bad store entries reach /metrics by tier and reason (through the store's stats path)."""

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block

from kvpool.core.hashing import hash_blocks
from kvpool.serve.metrics import KVStoreCollector
from kvpool.store.disk import SUBDIR, DiskTier, file_name
from kvpool.store.kv_store import TieredKVStore

HASHES = hash_blocks(list(range(8)), block_size=4, namespace="metrics")


def test_bad_entries_are_exported_by_tier_and_reason(tmp_path):
    store = TieredKVStore([DiskTier(tmp_path, 10**6)], NAMESPACE, SHAPE, DTYPE)
    for i in range(2):
        store.save(HASHES[i], make_block(i))
    path = tmp_path / SUBDIR / file_name(store.key(HASHES[1]))
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")  # same size, one byte changed
    assert len(store.load(HASHES[:2])) == 1
    engine = SimpleNamespace(kv_store=SimpleNamespace(store=store), scheduler=SimpleNamespace(num_external_hit_tokens=4))
    registry = CollectorRegistry()
    registry.register(KVStoreCollector(engine, "m"))
    text = generate_latest(registry).decode()
    assert 'kvpool:kv_store_bad_entries_total{model_name="m",reason="checksum",tier="disk"} 1.0' in text


def test_blocks_served_through_a_lossy_codec_are_exported_by_tier(tmp_path):
    import numpy as np

    shape = (2, 2, 4, 2, 8)
    store = TieredKVStore([DiskTier(tmp_path, 10**6)], NAMESPACE, shape, np.float32, codecs={"disk": "int8"})
    for i in range(2):
        store.save(HASHES[i], np.random.default_rng(i).standard_normal(shape).astype(np.float32))
    assert len(store.load(HASHES[:2])) == 2
    engine = SimpleNamespace(kv_store=SimpleNamespace(store=store), scheduler=SimpleNamespace(num_external_hit_tokens=8))
    registry = CollectorRegistry()
    registry.register(KVStoreCollector(engine, "m"))
    assert 'kvpool:kv_store_lossy_loads_total{model_name="m",tier="disk"} 2.0' in generate_latest(registry).decode()


def test_retained_blocks_a_tier_had_to_evict_are_exported_by_tier():
    import math

    from kvpool.core.retention import Retention, RetentionTable
    from kvpool.store.host import HostTier

    one = TieredKVStore([HostTier(1 << 20)], NAMESPACE, SHAPE, DTYPE)
    one.save(HASHES[0], make_block(0))
    store = TieredKVStore([HostTier(2 * one.stats()["host"].used_bytes)], NAMESPACE, SHAPE, DTYPE)
    table = RetentionTable()
    store.follow_retention(lambda: table)
    hashes = hash_blocks(list(range(16)), block_size=4, namespace="pinned")
    table.retain(hashes, Retention(math.inf))
    for i, block_hash in enumerate(hashes):  # every block pinned, room for two: two pinned victims
        store.save(block_hash, make_block(i))
    engine = SimpleNamespace(kv_store=SimpleNamespace(store=store), scheduler=SimpleNamespace(num_external_hit_tokens=0))
    registry = CollectorRegistry()
    registry.register(KVStoreCollector(engine, "m"))
    assert 'kvpool:kv_store_pinned_evictions_total{model_name="m",tier="host"} 2.0' in generate_latest(registry).decode()
