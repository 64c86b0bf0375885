import logging
from pathlib import Path

import numpy as np
from store_helpers import (
    DTYPE,
    NAMESPACE,
    SHAPE,
    make_block,
    needs_mooncake,
    race_put,
    retry_until,
    serve,
)

from kvpool.core.hashing import hash_blocks
from kvpool.store.format import encode_block
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.remote_mooncake import MooncakeTier
from kvpool.store.services import free_port, mooncake_master_service

pytestmark = needs_mooncake
HASHES = hash_blocks(list(range(40)), block_size=4, namespace="mooncake-test")


def url(service, segment_mb: int = 16) -> str:
    return f"mooncake://127.0.0.1:{service.port}?segment_mb={segment_mb}&buffer_mb=16"


def test_put_get_lookup_round_trip(mooncake_master):
    tier = MooncakeTier(url(mooncake_master))
    assert tier.put("rt:a", b"alpha") and tier.put("rt:b", b"beta" * 1000)
    assert tier.get("rt:a") == b"alpha" and tier.get("rt:b") == b"beta" * 1000
    assert tier.get("rt:zz") is None
    assert tier.lookup(["rt:a", "rt:b", "rt:zz", "rt:a"]) == 2
    tier.delete("rt:a")  # leased by the get above: best effort, must not raise
    s = tier.stats()
    assert s.hits == 2 and s.misses == 1 and s.puts == 2
    tier.close()


def test_concurrent_writers_of_one_block_are_harmless(mooncake_master):
    writers = [MooncakeTier(url(mooncake_master)) for _ in range(3)]
    value = b"v" * 100_000
    results = race_put(writers, "race:k", value)
    assert any(results)
    assert all(w.get("race:k") == value for w in writers)
    for w in writers:
        w.close()


def test_store_shares_blocks_between_clients_of_one_pool(mooncake_master):
    first = TieredKVStore([HostTier(10**6), MooncakeTier(url(mooncake_master))], NAMESPACE, SHAPE, DTYPE)
    for i, h in enumerate(HASHES[:3]):
        assert first.save(h, make_block(i))
    other = TieredKVStore([HostTier(10**6), MooncakeTier(url(mooncake_master))], NAMESPACE, SHAPE, DTYPE)
    assert other.lookup(HASHES[:4]) == (3, ["mooncake"] * 3)
    assert np.array_equal(other.load(HASHES[:3])[1], make_block(1))
    first.close()
    other.close()


def test_full_pool_fails_puts_cleanly_and_counts_them(tmp_path):
    for master in serve(mooncake_master_service(log_path=Path(tmp_path) / "m.log")):
        tier = MooncakeTier(url(master, segment_mb=16))
        # The master evicts in the background once past its watermark, so puts after the
        # first refusal may succeed again: stop at the first refusal.
        results = []
        while len(results) < 64 and (not results or results[-1]):
            results.append(tier.put(f"full:{len(results)}", b"z" * (1 << 20)))
        assert results[0] and not results[-1], "a 16 MB segment took 64 MB of puts"
        assert tier.get(f"full:{len(results) - 1}") is None  # a refused put leaves nothing behind
        assert tier.stats().failed_puts == 1
        assert not tier.health.down  # full is not an outage
        tier.close()


def test_killed_master_degrades_to_misses_with_one_warning_then_recovers(tmp_path, caplog):
    for master in serve(mooncake_master_service(log_path=Path(tmp_path) / "m.log")):
        tier = MooncakeTier(url(master), retry_s=0.2)
        assert tier.put("k:1", b"one")
        master.stop()
        with caplog.at_level(logging.WARNING, logger="kvpool.store.health"):
            for _ in range(3):
                assert tier.lookup(["k:1"]) == 0
                assert tier.get("k:1") is None
                assert tier.put("k:2", b"two") is False
        warnings = [r for r in caplog.records if "unreachable" in r.message]
        assert len(warnings) == 1 and tier.stats().errors >= 1
        master.start()
        retry_until(lambda tier=tier: tier.put("k:3", b"three"), attempts=150, pause_s=0.2, what="mooncake tier")
        assert tier.get("k:3") == b"three" and not tier.health.down
        tier.close()


def test_unreachable_master_at_start_is_a_miss_not_an_error():
    tier = MooncakeTier(f"mooncake://127.0.0.1:{free_port()}", retry_s=60)
    assert tier.health.down
    assert tier.lookup(["a"]) == 0 and tier.put("a", b"x") is False and tier.get("a") is None
    assert tier.stats().failed_puts == 1


def test_a_value_stored_under_another_blocks_key_is_refused(mooncake_master):
    tier = MooncakeTier(url(mooncake_master))
    store = TieredKVStore([tier], NAMESPACE, SHAPE, DTYPE)
    hashes = hash_blocks(list(range(500, 512)), block_size=4, namespace="mooncake-swap")
    store.save(hashes[0], make_block(0))
    assert tier.put(store.key(hashes[1]), encode_block(NAMESPACE, hashes[0], make_block(0)))  # block 0's value
    assert store.lookup(hashes[:2]) == (2, ["mooncake"] * 2)
    out = store.load(hashes[:2])
    assert len(out) == 1 and np.array_equal(out[0], make_block(0))
    assert store.stats()["mooncake"].bad_entries == {"identity": 1}
    store.close()
