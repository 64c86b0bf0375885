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
