"""GlobalKVIndex: prefix_match agrees with a brute-force scan under any event history."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.conductor.index import POOL, GlobalKVIndex
from kvpool.core.block_pool import BlockPool
from kvpool.core.retention import Retention

INSTANCES = ["p0", "p1", "d0", POOL]
HASHES = [bytes([i]) for i in range(8)]

events = st.lists(
    st.tuples(
        st.sampled_from(["stored", "evicted", "down"]),
        st.sampled_from(INSTANCES),
        st.lists(st.sampled_from(HASHES), max_size=6),
    ),
    max_size=40,
)


def _brute_force(held: dict[str, set[bytes]], query: list[bytes]) -> dict[str, int]:
    out = {}
    for inst, blocks in held.items():
        n = 0
        while n < len(query) and query[n] in blocks:
            n += 1
        if n:
            out[inst] = n
    return out


@settings(max_examples=200, deadline=None)
@given(events, st.lists(st.sampled_from(HASHES), max_size=8))
def test_prefix_match_equals_brute_force_after_any_events(history, query):
    index = GlobalKVIndex()
    held: dict[str, set[bytes]] = {}
    for kind, inst, hashes in history:
        if kind == "stored":
            index.on_stored(inst, hashes)
            held.setdefault(inst, set()).update(hashes)
        elif kind == "evicted":
            index.on_evicted(inst, hashes)
            held.get(inst, set()).difference_update(hashes)
        else:
            index.on_instance_down(inst)
            held.pop(inst, None)
    assert index.prefix_match(query) == _brute_force(held, query)
    for inst in INSTANCES:
        assert index.num_blocks(inst) == len(held.get(inst, ()))
    assert len(index) == len(set().union(*held.values()) if held else set())


def test_prefix_match_stops_each_instance_at_its_first_gap():
    index = GlobalKVIndex()
    chain = HASHES[:5]
    index.on_stored("a", chain)
    index.on_stored("b", chain[:2] + chain[3:])  # misses block 2
    index.on_stored("c", chain[1:])  # misses block 0: nothing usable
    assert index.prefix_match(chain) == {"a": 5, "b": 2}


def test_instance_down_forgets_only_that_instance():
    index = GlobalKVIndex()
    index.on_stored("a", HASHES[:3])
    index.on_stored(POOL, HASHES[:2])
    index.on_instance_down("a")
    assert index.prefix_match(HASHES[:3]) == {POOL: 2}
    assert index.holders(HASHES[2]) == frozenset()
    assert index.instances() == [POOL]


def test_evicting_unknown_blocks_is_ignored():
    index = GlobalKVIndex()
    index.on_evicted("a", HASHES[:2])
    index.on_stored("a", HASHES[:1])
    index.on_evicted("a", HASHES[1:3])
    assert index.prefix_match(HASHES[:2]) == {"a": 1}


def test_empty_query_matches_nothing():
    index = GlobalKVIndex()
    index.on_stored("a", HASHES)
    assert index.prefix_match([]) == {}


def test_a_watched_instance_holds_what_its_cache_holds_though_its_events_lost_their_order():
    """A block evicted and registered again between two drains is in both event lists, which
    do not say which came last: replayed, they dropped a block the cache held (the simulator's
    conductor did, once over the conversation trace). A watched cache is read as it is."""
    pool = BlockPool(num_blocks=1, block_size=1, record_events=True)
    index = GlobalKVIndex()
    index.watch("p0", pool.cached_hashes())
    (b,) = pool.allocate(1, 1)
    pool.register(b, HASHES[0])
    pool.release([b])
    (b,) = pool.allocate(1, 1)  # evicts it
    pool.register(b, HASHES[0])  # the same content, computed again
    events = pool.drain_events()
    assert events.stored == [HASHES[0], HASHES[0]] and events.evicted == [HASHES[0]]
    index.on_stored("p0", events.stored)
    index.on_evicted("p0", events.evicted)
    assert index.prefix_match(HASHES[:1]) == {"p0": 1}
    assert index.holders(HASHES[0]) == frozenset({"p0"}) and index.instances() == ["p0"]
    pool.release([b])
    pool.allocate(1)  # evicted for good
    index.on_evicted("p0", pool.drain_events().evicted)
    assert index.prefix_match(HASHES[:1]) == {} and index.num_blocks("p0") == 0 and index.instances() == []


def test_a_watched_instance_still_reports_retention_and_forgets_it_on_eviction():
    cache = {HASHES[0], HASHES[1]}
    index = GlobalKVIndex()
    index.watch("p0", cache)
    index.on_retention("p0", {HASHES[0]: Retention(10.0), HASHES[1]: Retention(10.0), HASHES[2]: Retention(10.0)})
    assert index.retained_match(HASHES[:3], now=5.0) == {"p0": 2}  # HASHES[2] is not held
    cache.discard(HASHES[1])
    index.on_evicted("p0", [HASHES[1]])
    assert index.retained_match(HASHES[:3], now=5.0) == {"p0": 1}
    assert index.num_retained("p0", now=5.0) == 1
    index.on_evicted("p0", [HASHES[0]])  # evicted, then stored again before the drain: still held
    assert index.retained_match(HASHES[:3], now=5.0) == {"p0": 1}


def test_an_instance_down_is_no_longer_watched():
    cache = {HASHES[0]}
    index = GlobalKVIndex()
    index.watch("p0", cache)
    index.on_instance_down("p0")
    assert index.prefix_match(HASHES[:1]) == {}
    index.on_stored("p0", HASHES[1:2])  # back up: what it stores from now on, replayed
    assert index.prefix_match(HASHES[1:2]) == {"p0": 1} and index.num_blocks("p0") == 1
