"""Each tier's read cost is measured on every real read (a delay injected into a tier's reads
shows in its estimate), reaches the planner through `read_costs` and /metrics as gauges."""

import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block

from kvpool.core.hashing import hash_blocks
from kvpool.serve.metrics import KVStoreCollector
from kvpool.store.disk import DiskTier
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore

HASHES = hash_blocks(list(range(16)), block_size=4, namespace="estimates")


class SlowDisk(DiskTier):
    """A disk tier whose every read waits `delay_s` first (a tier made slow on purpose)."""

    delay_s = 0.02

    def get(self, key):
        time.sleep(self.delay_s)
        return super().get(key)


def test_a_slow_tier_reads_slower_than_a_fast_one_in_the_estimates(tmp_path):
    store = TieredKVStore([HostTier(10**7), SlowDisk(tmp_path, 10**7)], NAMESPACE, SHAPE, DTYPE)
    assert store.read_costs() == {}  # nothing read yet: nothing to price with
    for i in range(4):
        store.save(HASHES[i], make_block(i))
    assert len(store.load(HASHES[:4])) == 4  # from the host tier
    for i in range(4):
        store.tiers[0].delete(store.key(HASHES[i]))
    assert len(store.load(HASHES[:4])) == 4  # from the slow disk (and promoted)
    costs = store.read_costs()
    nbytes = len(store.tiers[1].get(store.key(HASHES[0])))
    assert costs["disk"].seconds(nbytes) >= SlowDisk.delay_s > costs["host"].seconds(nbytes)
    assert store.read_costs(max_age_s=0.0) == {}  # stale estimates are left out
    stats = store.stats()
    assert stats["disk"].read_bandwidth > 0 and stats["host"].read_bandwidth > stats["disk"].read_bandwidth
    store.close()


def test_read_estimates_are_exported_as_gauges(tmp_path):
    store = TieredKVStore([DiskTier(tmp_path, 10**6)], NAMESPACE, SHAPE, DTYPE)
    store.save(HASHES[0], make_block(0))
    assert len(store.load(HASHES[:1])) == 1
    engine = SimpleNamespace(kv_store=SimpleNamespace(store=store), scheduler=SimpleNamespace(num_external_hit_tokens=4))
    registry = CollectorRegistry()
    registry.register(KVStoreCollector(engine, "m"))
    text = generate_latest(registry).decode()
    assert 'kvpool:kv_store_read_latency_seconds{model_name="m",tier="disk"}' in text
    line = next(x for x in text.splitlines() if x.startswith('kvpool:kv_store_read_bandwidth_bytes{model_name="m"'))
    assert float(line.split()[-1]) > 0
    store.close()
