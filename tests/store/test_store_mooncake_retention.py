"""Retention and layer-wise reads in the Mooncake Store tier (issue 32, items 1 and 4), against a
real mooncake_master: retained blocks carry the master's soft pin, so a pool filled past its
segment evicts the unretained and keeps them; a pin reaches a block written before it (rewritten
with its own bytes) and an unpin drops it; range reads give each layer, refuse a replaced object."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import pytest
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block, needs_mooncake, serve

from kvpool.core.retention import Retention, RetentionTable
from kvpool.store.format import CorruptBlock, check_head
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.layered import LayeredBlock, LayerUnavailable
from kvpool.store.remote_mooncake import MooncakeTier
from kvpool.store.retained import TierRetention
from kvpool.store.services import mooncake_master_service

pytestmark = needs_mooncake
PINNED = Retention(math.inf)
MIB = 1 << 20


def url(service, query: str = "") -> str:
    return f"mooncake://127.0.0.1:{service.port}?segment_mb=16&buffer_mb=16{query}"


def key(i: int) -> str:
    return "t:" + i.to_bytes(16, "big").hex()


def following(service, query: str = "") -> tuple[MooncakeTier, RetentionTable]:
    """A tier following a retention table as the store points it (keys `t:<hash hex>`)."""
    tier = MooncakeTier(url(service, query))
    table = RetentionTable()
    table.advance(time.monotonic())
    tier.retention = TierRetention(lambda: table, "t:")
    return tier, table


def fill(tier: MooncakeTier, first: int, n: int) -> None:
    """`n` unretained 1 MiB blocks; a put refused while the master evicts is retried after a pause
    (its eviction runs in the background: a bounded wait for room, not a speed target)."""
    for i in range(first, first + n):
        for _ in range(20):
            if tier.put(key(i), b"u" * MIB):
                break
            time.sleep(0.2)


def held(tier: MooncakeTier, ids) -> set[int]:
    return {i for i in ids if tier.contains(key(i))}


@pytest.fixture
def master(tmp_path):
    yield from serve(mooncake_master_service(log_path=Path(tmp_path) / "master.log"))


def test_soft_pinned_blocks_survive_a_pool_filled_past_its_segment(master):
    tier, table = following(master)
    table.retain([bytes.fromhex(key(i)[2:]) for i in range(3)], PINNED)
    table.retain([bytes.fromhex(key(3)[2:])], Retention(table.now + 600.0))
    for i in range(4):
        assert tier.put(key(i), bytes([i]) * MIB)
    fill(tier, 100, 48)  # 48 MiB through a 16 MiB segment
    assert held(tier, range(4)) == {0, 1, 2, 3}
    assert len(held(tier, range(100, 148))) < 16  # the master evicted unretained blocks
    s = tier.stats()
    assert s.retention_applied == 4 and s.pinned_evictions == 0 and s.retention_unhonoured == 0
    assert tier.get(key(2)) == bytes([2]) * MIB
    tier.close()


@pytest.mark.slow
def test_a_block_pinned_after_it_was_written_is_pinned_when_read(master):
    tier, table = following(master)
    assert tier.put(key(0), b"a" * MIB) and tier.put(key(1), b"b" * MIB)
    table.retain([bytes.fromhex(key(0)[2:])], PINNED)
    assert tier.get(key(0)) == b"a" * MIB  # rewritten with its own bytes and the pin
    fill(tier, 100, 48)
    assert held(tier, range(2)) == {0}
    assert tier.stats().retention_applied == 1
    tier.close()


@pytest.mark.slow
def test_an_unpin_drops_the_soft_pin(tmp_path):
    """(The unpin reads the object to rewrite it; that read's lease is kept short here.)"""
    for master in serve(mooncake_master_service(lease_ttl_ms=100, log_path=Path(tmp_path) / "master.log")):
        _unpin_drops_the_pin(master)


def _unpin_drops_the_pin(master) -> None:
    tier, table = following(master)
    tier.restate_s = 0.0
    table.retain([bytes.fromhex(key(0)[2:])], PINNED)
    assert tier.put(key(0), b"a" * MIB)
    table.release([bytes.fromhex(key(0)[2:])])
    tier.stats()  # restates: the object rewritten unpinned
    assert tier.stats().retention_applied == 2
    fill(tier, 100, 48)
    assert held(tier, [0]) == set()
    tier.close()


@pytest.mark.slow
def test_a_pin_the_master_refuses_is_reported_and_the_block_still_written(master, caplog):
    tier, table = following(master, "&soft_pin_max_s=1000000")  # the master allows a day
    table.retain([bytes.fromhex(key(0)[2:])], PINNED)
    with caplog.at_level(logging.WARNING, logger="kvpool.store.remote_mooncake"):
        assert tier.put(key(0), b"a" * 1000) and tier.put(key(1), b"b" * 1000)
    assert tier.pins_refused and tier.get(key(0)) == b"a" * 1000
    assert any("refused a soft pin" in r.message for r in caplog.records)
    s = tier.stats()
    assert s.retention_unhonoured == 1 and s.retention_applied == 0 and not tier.health.down
    tier.close()


def _store(master) -> tuple[TieredKVStore, MooncakeTier]:
    tier = MooncakeTier(url(master))
    return TieredKVStore([tier], NAMESPACE, SHAPE, DTYPE), tier


H = [bytes([i]) * 16 for i in range(3)]


def test_a_mooncake_block_read_layer_by_layer_equals_the_whole_read(master):
    store, tier = _store(master)
    for i, h in enumerate(H):
        store.save(h, make_block(i))
    layered = store.load(H, layered=[t.name for t in store.tiers])
    assert len(layered) == 3 and all(isinstance(b, LayeredBlock) and b.tier == "mooncake" for b in layered)
    for i, got in enumerate(layered):
        for layer in range(SHAPE[0]):
            np.testing.assert_array_equal(got[layer], make_block(i)[layer])
    assert tier.stats().hits == 3
    store.close()


def test_a_flipped_layer_in_mooncake_fails_its_check_and_a_replaced_object_is_refused(master):
    store, tier = _store(master)
    store.save(H[0], make_block(0))
    store.save(H[1], make_block(1))
    value = bytearray(tier.get(store.key(H[0])))
    offset, length, _ = check_head(value, len(value), NAMESPACE, SHAPE, DTYPE, H[0]).layers[1]
    value[offset + length // 2] ^= 0x20
    with tier._lock:
        assert tier._client.upsert(store.key(H[0]), bytes(value)) == 0
    (block,) = store.load(H[:1], layered=[t.name for t in store.tiers])
    np.testing.assert_array_equal(block[0], make_block(0)[0])
    with pytest.raises(CorruptBlock) as err:
        block[1]
    assert err.value.reason == "checksum"
    (other,) = store.load(H[1:2], layered=[t.name for t in store.tiers])
    with tier._lock:  # block 0's value put under block 1's key after block 1's header was read
        assert tier._client.upsert(store.key(H[1]), bytes(tier._client.get(store.key(H[0])))) == 0
    with pytest.raises(LayerUnavailable):
        other[0]
    store.close()
