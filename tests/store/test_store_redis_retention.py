"""Retention in the Redis tier (issue 32, item 1) through Redis's own eviction: under a volatile-*
policy unretained blocks carry an expiry and retained ones none, so a real redis-server filled past
its maxmemory evicts the unretained and keeps the retained; a lapsed retention gives the key its
expiry back; a policy that cannot honour retention is reported, never claimed."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import redis
from store_helpers import needs_redis, serve

from kvpool.core.retention import Retention, RetentionTable
from kvpool.errors import ConfigError
from kvpool.store.format import block_namespace, block_shape
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.remote_redis import (
    PRIORITY_EXPIRE_S,
    RETAINED_EXPIRE_S,
    UNKNOWN_POLICY,
    RedisTier,
)
from kvpool.store.services import LocalService, redis_service

pytestmark = needs_redis
PINNED = Retention(math.inf)
SHAPE = block_shape(num_layers=4, block_size=16, num_kv_heads=4, head_dim=32)  # 32 KiB in float16
NAMESPACE = block_namespace("retention-test", "float16", 16, 4, 4, 32)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(SHAPE).astype(np.float16)


def pool(tmp_path, policy: str, maxmemory: str = "0", extra: tuple[str, ...] = ()) -> LocalService:
    service = redis_service(maxmemory=maxmemory, policy=policy, log_path=Path(tmp_path) / "redis.log")
    service.argv += list(extra)
    return service


def following(service: LocalService, query: str = "") -> tuple[TieredKVStore, RedisTier, RetentionTable]:
    """A store of one Redis tier following a retention table (as the engine's device pool's)."""
    tier = RedisTier(f"redis://127.0.0.1:{service.port}/0{query}")
    store = TieredKVStore([tier], NAMESPACE, SHAPE, np.float16)
    table = RetentionTable()
    table.advance(100.0)
    store.follow_retention(lambda: table)
    return store, tier, table


def pinned_first(service: LocalService, query: str = "") -> tuple[TieredKVStore, RedisTier, RetentionTable]:
    """`following`, with block 0 pinned and saved, block 1 saved unretained."""
    store, tier, table = following(service, query)
    table.retain([h(0)], PINNED)
    store.save(h(0), block(0))
    store.save(h(1), block(1))
    return store, tier, table


def ttl(service: LocalService, store: TieredKVStore, i: int) -> int:
    """Redis's TTL of block i's key: -1 no expiry, -2 no key."""
    return redis.Redis(port=service.port).ttl(store.key(h(i)))


def present(store: TieredKVStore, ids) -> set[int]:
    return {i for i in ids if store.lookup([h(i)])[0]}


def test_under_a_volatile_policy_a_full_pool_evicts_the_unretained_and_keeps_the_retained(tmp_path):
    for service in serve(pool(tmp_path, "volatile-lru", maxmemory="4mb")):
        store, tier, table = following(service)
        kept = [0, 3, 7, 11, 20, 31]
        table.retain([h(i) for i in kept[:4]], PINNED)
        table.retain([h(i) for i in kept[4:]], Retention(until=10_000.0, priority=5))  # a TTL
        for i in range(240):  # ~7.5 MiB of blocks into a 4 MiB pool
            assert store.save(h(i), block(i)), f"block {i} refused: nothing unretained to evict?"
        held = present(store, range(240))
        assert set(kept) <= held
        assert len(held) < 120  # Redis evicted over half the blocks: every one of them unretained
        assert all(ttl(service, store, i) == -1 for i in kept)
        assert all(ttl(service, store, i) != -1 for i in held - set(kept))  # expiring (or evicted since)
        np.testing.assert_array_equal(store.load([h(3)])[0], block(3))
        s = tier.stats()
        assert tier.honours_retention and tier.policy == "volatile-lru"
        assert s.failed_puts == 0 and s.pinned_evictions == 0 and s.retention_unhonoured == 0
        assert s.retention_applied == len(kept)
        store.close()


def test_under_volatile_ttl_retained_blocks_go_last_and_lower_priority_first(tmp_path):
    """volatile-ttl evicts the nearest expiry first: unretained blocks go, then the low-priority
    retained ones (counted as pinned evictions), and the high-priority ones stay."""
    for service in serve(pool(tmp_path, "volatile-ttl", maxmemory="4mb", extra=("--maxmemory-samples", "64"))):
        store, tier, table = following(service)
        high, low = set(range(0, 240, 4)), set(range(1, 240, 4)) | set(range(2, 240, 4))
        unretained = set(range(240)) - high - low
        table.retain([h(i) for i in high], Retention(math.inf, priority=50))
        table.retain([h(i) for i in low], Retention(math.inf, priority=0))
        for i in range(240):  # ~7.5 MiB into a 4 MiB pool; the retained alone are ~5.6 MiB
            assert store.save(h(i), block(i)), f"block {i} refused"
        assert ttl(service, store, 0) > ttl(service, store, 1) + PRIORITY_EXPIRE_S - 100
        held = present(store, range(240))
        assert high <= held
        assert len(held & unretained) <= 2  # Redis samples keys: at most a stray one left
        assert 0 < len(low - held) < len(low)
        assert 0 < tier.stats().pinned_evictions <= len(low - held)
        store.close()


def test_a_lapsed_retention_gives_the_key_its_expiry_back(tmp_path):
    for service in serve(pool(tmp_path, "volatile-ttl")):
        store, tier, table = following(service, "?idle_expire_s=500")
        tier.restate_s = 0.0
        table.retain([h(0)], PINNED)
        table.retain([h(1)], Retention(until=110.0))
        for i in range(3):
            store.save(h(i), block(i))
        # volatile-ttl: retained keys carry a far expiry (RETAINED_EXPIRE_S), not none
        assert all(ttl(service, store, i) > RETAINED_EXPIRE_S - 100 for i in range(2))
        assert 0 < ttl(service, store, 2) <= 500
        table.release([h(0)])  # an unpin
        table.advance(111.0)  # block 1's TTL runs out
        tier.stats()
        assert all(0 < ttl(service, store, i) <= 500 for i in range(3))
        assert tier.stats().retention_applied == 4  # two stated, two restated
        store.close()


def test_a_block_pinned_after_it_was_written_is_persisted_when_looked_up(tmp_path):
    for service in serve(pool(tmp_path, "volatile-lru")):
        store, tier, table = following(service)
        store.save(h(0), block(0))
        assert ttl(service, store, 0) > 0
        table.retain([h(0)], PINNED)
        assert store.lookup([h(0)])[0] == 1 and ttl(service, store, 0) == -1
        store.close()  # the instance's retentions end with it
        assert ttl(service, store, 0) > 0


def test_a_read_pushes_an_unretained_blocks_expiry_back(tmp_path):
    for service in serve(pool(tmp_path, "volatile-lru")):
        store, tier, _ = following(service, "?idle_expire_s=900")
        store.save(h(0), block(0))
        redis.Redis(port=service.port).expire(store.key(h(0)), 5)
        assert len(store.load([h(0)])) == 1 and ttl(service, store, 0) > 5
        store.close()


def test_a_retained_block_gone_from_the_pool_is_a_counted_pinned_eviction(tmp_path):
    for service in serve(pool(tmp_path, "volatile-lru")):
        store, tier, _ = pinned_first(service)
        redis.Redis(port=service.port).delete(store.key(h(0)))
        assert store.lookup([h(0)])[0] == 0
        assert tier.stats().pinned_evictions == 1
        store.close()


def test_an_allkeys_policy_is_reported_as_not_honouring_retention(tmp_path, caplog):
    for service in serve(pool(tmp_path, "allkeys-lru", maxmemory="4mb")):
        with caplog.at_level(logging.WARNING, logger="kvpool.store.remote_redis"):
            store, tier, table = following(service)
            table.retain([h(i) for i in range(20)], PINNED)
            for i in range(240):
                store.save(h(i), block(i))
        assert tier.honours_retention is False
        assert any("NOT honoured" in r.message and "allkeys-lru" in r.message for r in caplog.records)
        s = tier.stats()
        assert s.retention_unhonoured == 20 and s.retention_applied == 0
        assert ttl(service, store, 239) == -1  # no expiries where they do not decide eviction
        gone = 20 - len(present(store, range(20)))
        assert gone > 0 and tier.stats().pinned_evictions == gone  # the pool dropped pinned blocks: counted
        store.close()


def test_noeviction_sets_no_expiries(tmp_path):
    for service in serve(pool(tmp_path, "noeviction")):
        store, tier, _ = pinned_first(service)
        assert [ttl(service, store, i) for i in range(2)] == [-1, -1] and tier.honours_retention
        store.close()


def test_a_server_that_refuses_config_get_is_logged_and_treated_as_volatile(tmp_path, caplog):
    for service in serve(pool(tmp_path, "volatile-lru", extra=("--rename-command", "CONFIG", ""))):
        with caplog.at_level(logging.WARNING, logger="kvpool.store.remote_redis"):
            store, tier, _ = pinned_first(service)
        assert tier.policy == UNKNOWN_POLICY
        assert any("cannot read maxmemory-policy" in r.message for r in caplog.records)
        assert ttl(service, store, 0) == -1 and ttl(service, store, 1) > 0
        store.close()


@pytest.mark.parametrize("bad", ["0", "-5", "soon"])
def test_a_bad_idle_expiry_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match="idle_expire_s"):
        RedisTier(f"redis://127.0.0.1:1/0?idle_expire_s={bad}")


def test_the_remote_retention_counters_reach_metrics(tmp_path):
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from kvpool.serve.metrics import KVStoreCollector

    for service in serve(pool(tmp_path, "volatile-lru")):
        store, _, _ = pinned_first(service)
        engine = SimpleNamespace(kv_store=SimpleNamespace(store=store),
                                 scheduler=SimpleNamespace(num_external_hit_tokens=0))
        registry = CollectorRegistry()
        registry.register(KVStoreCollector(engine, "m"))
        text = generate_latest(registry).decode()
        assert 'kvpool:kv_store_retention_applied_total{model_name="m",tier="redis"} 1.0' in text
        assert 'kvpool:kv_store_retention_unhonoured_total{model_name="m",tier="redis"} 0.0' in text
        store.close()
