"""An instance's KV event log as the conductor's poller reads it: a poller several drains behind
gets each block as its last event left it, so replaying the answer leaves the conductor's index
holding what the instance holds."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.conductor.index import GlobalKVIndex
from kvpool.serve.internal import KVEventLog

A, B, C = b"\xaa", b"\xbb", b"\xcc"


def _replay(index: GlobalKVIndex, answer: dict) -> None:
    """What the member poller (cluster/members.py) does with a delta."""
    index.on_stored("p0", [bytes.fromhex(h) for h in answer["stored"]])
    index.on_evicted("p0", [bytes.fromhex(h) for h in answer["evicted"]])


def test_a_block_evicted_then_stored_again_two_drains_behind_reads_as_held():
    log = KVEventLog()
    log.add([A, B], [])
    index = GlobalKVIndex()
    _replay(index, log.since(0, now=0.0))  # a snapshot
    cursor = log.cursor
    log.add([C], [A])  # A evicted, C stored
    log.add([A], [C])  # A stored again, C evicted: the poller missed the drain before
    delta = log.since(cursor, now=0.0)
    assert (delta["stored"], delta["evicted"]) == ([A.hex()], [C.hex()])
    _replay(index, delta)
    assert index.prefix_match([A, B]) == {"p0": 2} and index.num_blocks("p0") == 2


drains = st.lists(st.tuples(st.sets(st.sampled_from([A, B, C])), st.sets(st.sampled_from([A, B, C]))), max_size=8)


@settings(max_examples=200, deadline=None)
@given(drains, drains)
def test_any_delta_replayed_leaves_the_index_holding_what_the_log_holds(before, after):
    """Each drain is net (a block in at most one of its lists), as `Engine.drain_kv_events` gives."""
    log = KVEventLog()
    for stored, evicted in before:
        log.add(sorted(stored), sorted(evicted - stored))
    index = GlobalKVIndex()
    _replay(index, log.since(0, now=0.0))
    cursor = log.cursor
    for stored, evicted in after:
        log.add(sorted(stored), sorted(evicted - stored))
    if log.cursor > cursor:
        _replay(index, log.since(cursor, now=0.0))
    assert {h for h in (A, B, C) if index.holders(h)} == log.held
