"""Retention on the wire between an instance and the conductor (issue 32 item 1): the
instance's event log reports a TTL left (its clock is not the conductor's), deltas and snapshots
alike, and the member poller turns it back into a deadline on the conductor's clock."""

import math

from kvpool.cluster.members import retention_of
from kvpool.core.retention import Retention
from kvpool.serve.internal import KVEventLog

A, B, C = b"\xaa", b"\xbb", b"\xcc"


def test_a_delta_reports_the_ttl_left_of_stored_and_re_retained_held_blocks():
    log = KVEventLog()
    log.add([A, B], [], {A: Retention(110.0, 2)})
    cursor = log.cursor
    assert log.since(0, now=100.0)["retention"] == {A.hex(): {"ttl_s": 10.0, "priority": 2}}  # a snapshot
    log.add([C], [], {B: Retention(math.inf, 5)})  # a pin of a block already held
    delta = log.since(cursor, now=105.0)
    assert (delta["snapshot"], delta["stored"]) == (False, [C.hex()])
    assert delta["retention"] == {B.hex(): {"ttl_s": None, "priority": 5}}


def test_an_unpin_an_expiry_and_an_eviction_reach_the_conductor():
    log = KVEventLog()
    log.add([A, B], [], {A: Retention(110.0, 0), B: Retention(math.inf, 0)})
    cursor = log.cursor
    log.add([], [], {B: None})
    assert log.since(cursor, now=100.0)["retention"] == {B.hex(): None}
    assert log.since(0, now=120.0)["retention"] == {A.hex(): None}  # a snapshot: A ran out, B released
    cursor = log.cursor
    log.add([], [A], {})
    delta = log.since(cursor, now=100.0)
    assert delta["evicted"] == [A.hex()] and delta["retention"] == {} and not log.retained


def test_the_poller_reads_a_ttl_as_a_deadline_on_its_own_clock():
    wire = {A.hex(): {"ttl_s": 10.0, "priority": 2}, B.hex(): {"ttl_s": None, "priority": 5}, C.hex(): None}
    assert retention_of(wire, now=1000.0) == {A: Retention(1010.0, 2), B: Retention(math.inf, 5), C: None}
