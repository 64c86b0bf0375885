"""KV events carry retention (issue 32 item 1): a stored block's event has its live retention,
and a cached block whose retention changes (a pin, an extension, an unpin) is reported again."""

import math

from kvpool.core.block_pool import BlockPool
from kvpool.core.retention import Retention, table_of

B = 4


def _cached(pool: BlockPool, h: bytes) -> int:
    """A computed block registered under `h`, its sequence ended: cached, evictable."""
    (b,) = pool.allocate(1, B)
    pool.register(b, h)
    pool.release([b])
    return b


def test_a_stored_blocks_event_carries_its_live_retention():
    pool = BlockPool(8, B, record_events=True)
    table_of(pool).retain([b"a"], Retention(10.0, 3))  # retained before it is computed
    _cached(pool, b"a")
    _cached(pool, b"b")
    ev = pool.drain_events()
    assert ev.stored == [b"a", b"b"]
    assert ev.retention == {b"a": Retention(10.0, 3)}  # b has none: not reported


def test_a_pin_on_a_cached_block_is_an_event_and_an_unpin_reports_none():
    pool = BlockPool(8, B, record_events=True)
    _cached(pool, b"a")
    pool.drain_events()
    table = table_of(pool)
    table.retain([b"a", b"never-cached"], Retention(math.inf, 1))
    assert pool.has_events  # a driver that skips empty drains still publishes the pin
    ev = pool.drain_events()
    assert (ev.stored, ev.retention) == ([], {b"a": Retention(math.inf, 1)})  # only what it holds
    assert not pool.has_events
    table.retain([b"a"], Retention(5.0, 7))  # merged: still a pin, now priority 7
    assert pool.drain_events().retention == {b"a": Retention(math.inf, 7)}
    table.release([b"a"])
    assert pool.drain_events().retention == {b"a": None}


def test_an_expiry_is_not_an_event_the_reader_expires_until_itself():
    pool = BlockPool(8, B, record_events=True)
    table_of(pool).retain([b"a"], Retention(10.0, 0))
    _cached(pool, b"a")
    pool.drain_events()
    pool.retention.advance(11.0)
    assert pool.retention.num_ttl_expiries == 1
    assert not pool.has_events and pool.drain_events().retention == {}


def test_a_pool_without_events_tracks_no_retention_changes():
    pool = BlockPool(8, B)
    table = table_of(pool)
    table.retain([b"a"], Retention(10.0, 0))
    assert table.changed is None and not pool.has_events
