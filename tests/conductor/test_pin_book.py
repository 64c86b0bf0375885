"""The conductor's book of cluster pins (issue 32 item 1): what each instance, at its boot id, is
still owed, so that one that was down, restarted or timed out gets the cluster's pins when it
joins, and the unpins it missed while it keeps its boot id."""

import math

from conductor_helpers import CHAIN

from kvpool.conductor.pins import ClusterPin, ClusterUnpin, PinBook

A = tuple(range(64))  # token ids of a 4-block prefix (its hashes: CHAIN[0..3])
B = tuple(range(100, 132))  # another prefix, 2 blocks (CHAIN[10..11])


def _pin(book: PinBook, until: float = math.inf, priority: int = 0, took=None, ids=A, first=0, last=3) -> ClusterPin:
    """A pin recorded, then taken by the instances in `took` (instance -> boot id), as the route does."""
    record, _ = book.pin(CHAIN[last], CHAIN[first], ids, None, until, priority)
    if (record.until, record.priority) == (until, priority):
        for inst, boot in (took or {}).items():
            book.confirm(record, inst, boot)
    return record


def _unpin(book: PinBook, ids=A, owed_to=None, took=None) -> int:
    dropped, record = book.unpin(CHAIN[0], ids, None, owed_to or {})
    for inst, boot in (took or {}).items():
        book.confirm(record, inst, boot)
    return len(dropped)


def _owed(book: PinBook, inst: str, boot: str, now: float = 0.0) -> list:
    return [(type(op).__name__, op.ids) for op in book.owed(inst, boot, now)]


def test_an_instance_that_joins_or_restarts_is_owed_every_live_pin_until_it_confirms():
    book = PinBook()
    p = _pin(book, took={"i0": "boot-a"})
    assert _owed(book, "i0", "boot-a") == []
    assert _owed(book, "i1", "boot-x") == [("ClusterPin", A)]  # down at the fan-out, joins now
    book.confirm(p, "i1", "boot-x")
    assert _owed(book, "i1", "boot-x") == []
    assert _owed(book, "i0", "boot-b") == [("ClusterPin", A)]  # restarted: its pins are gone
    assert p.ttl_left(5.0) is None


def test_a_pin_is_owed_with_the_time_left_and_forgotten_when_it_runs_out():
    book = PinBook()
    p = _pin(book, until=100.0, took={"i0": "a"})
    assert p.ttl_left(40.0) == 60.0
    assert _owed(book, "i1", "x", now=99.0) == [("ClusterPin", A)]
    assert _owed(book, "i1", "x", now=100.0) == [] and len(book) == 0 and book.pins(100.0) == []


def test_pinning_again_merges_and_owes_the_merge_to_whoever_holds_only_the_weaker_pin():
    book = PinBook()
    _pin(book, until=100.0, priority=5, took={"i0": "a", "i1": "b"})
    merged = _pin(book, until=200.0, priority=1, took={"i0": "a", "i2": "c"})
    assert (merged.until, merged.priority) == (200.0, 5)  # the later end, the higher priority
    assert _owed(book, "i1", "b") == [("ClusterPin", A)]  # holds the old end only
    assert _owed(book, "i2", "c") == [("ClusterPin", A)]  # holds the new one's priority only
    again = _pin(book, until=200.0, priority=5, took={"i0": "a"})
    assert again.holders == {"i0": "a"} and _owed(book, "i0", "a") == []
    assert _pin(book, until=150.0, priority=5).holders == {"i0": "a"}  # changes nothing: still held


def test_a_pin_or_unpin_no_instance_took_is_undone():
    book = PinBook()
    first, _ = book.pin(CHAIN[3], CHAIN[0], A, None, 100.0, 0)
    book.confirm(first, "i0", "a")
    record, before = book.pin(CHAIN[3], CHAIN[0], A, None, 200.0, 0)
    book.undo_pin(record, before)
    assert book.pins(0.0) == [first] and _owed(book, "i0", "a") == []
    dropped, unpin = book.unpin(CHAIN[0], A, None, {"i0": "a", "i1": "b"})
    book.undo_unpin(dropped, unpin)
    assert book.pins(0.0) == [first] and _owed(book, "i0", "a") == [] and _owed(book, "i1", "b") == [("ClusterPin", A)]


def test_a_confirmation_of_a_pin_merged_or_dropped_since_it_was_sent_does_not_count():
    book = PinBook()
    sent = _pin(book, until=100.0)
    _pin(book, until=200.0)
    book.confirm(sent, "i1", "b")  # a replay of the weaker pin, in flight during the merge
    assert _owed(book, "i1", "b") == [("ClusterPin", A)]
    current = book.owed("i1", "b", 0.0)[0]
    _unpin(book)
    book.confirm(current, "i1", "b")
    assert len(book) == 0 and _owed(book, "i1", "b") == []


def test_an_unpin_drops_every_pin_sharing_its_first_block_and_is_owed_to_who_missed_it():
    book = PinBook()
    _pin(book, took={"i0": "a", "i1": "b"})
    _pin(book, ids=A[:32], last=1, took={"i0": "a", "i1": "b"})  # a shorter pin of the same head
    _pin(book, ids=B, first=10, last=11, took={"i0": "a", "i1": "b"})
    dropped = _unpin(book, A[:16], owed_to={"i0": "a", "i1": "b", "i2": "c"}, took={"i0": "a"})
    assert dropped == 2 and [p.ids for p in book.pins(0.0)] == [B]
    assert _owed(book, "i0", "a") == []  # took the unpin
    assert _owed(book, "i1", "b") == [("ClusterUnpin", A[:16])]  # missed it, same process
    unpin = book.owed("i1", "b", 0.0)[0]
    assert isinstance(unpin, ClusterUnpin)
    book.confirm(unpin, "i1", "b")
    assert _owed(book, "i1", "b") == []
    assert _owed(book, "i2", "c2") == [("ClusterPin", B)]  # restarted since: nothing to release


def test_a_later_pin_an_instance_took_supersedes_the_unpin_it_missed():
    book = PinBook()
    _pin(book, took={"i1": "b"})
    _unpin(book, owed_to={"i1": "b"})
    _pin(book, until=50.0, took={"i0": "a"})  # pinned again while i1 was away
    assert _owed(book, "i1", "b") == [("ClusterUnpin", A), ("ClusterPin", A)]  # release first, then pin
    again = _pin(book, until=50.0, took={"i1": "b"})
    assert again.holders == {"i0": "a", "i1": "b"} and _owed(book, "i1", "b") == []


def test_an_owed_unpin_of_a_pin_that_ran_out_is_forgotten():
    book = PinBook()
    _pin(book, until=10.0, took={"i1": "b"})
    _unpin(book, owed_to={"i1": "b"})
    assert _owed(book, "i1", "b", now=9.0) == [("ClusterUnpin", A)]
    assert _owed(book, "i1", "b", now=10.0) == []
