"""Retention in the device pool's eviction (core/retention.py), against a brute-force model of
the rule: unretained (or expired) blocks first in the policy's order, then retained ones lower
priority first; a retained victim is a counted pinned eviction; expiry is lazy and counted."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.block_pool import BlockPool
from kvpool.core.kv_manager import KVCacheManager
from kvpool.core.retention import (
    Retention,
    RetentionRequest,
    pinned_blocks,
    release_prompt,
    retain_prompt,
    table_of,
)
from kvpool.errors import InvalidRequest

NUM_BLOCKS = 6


class Model:
    """The rule, the slow obvious way: every evictable key's base rank by policy, then sort."""

    def __init__(self, policy: str) -> None:
        self.policy, self.clock, self.now = policy, 0, -math.inf
        self.present: set[bytes] = set()
        self.first: dict[bytes, int] = {}  # FIFO ticket, kept until evicted
        self.last: dict[bytes, int] = {}  # LRU / LFU recency
        self.count: dict[bytes, int] = {}  # LFU, kept until evicted
        self.held: dict[bytes, tuple[float, int]] = {}
        self.expiries = self.pinned_evictions = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def insert(self, h: bytes) -> None:  # a block became evictable
        self.present.add(h)
        self.first.setdefault(h, self.tick())
        self.last[h] = self.tick()
        self.count[h] = self.count.get(h, 0) + 1

    def touch(self, h: bytes) -> None:
        if self.policy != "fifo":
            self.last[h] = self.tick()
            self.count[h] += 1

    def rank(self, h: bytes):
        base = {"fifo": self.first[h], "lru": self.last[h], "lfu": (self.count[h], self.last[h])}[self.policy]
        r = self.held.get(h)
        return (0, 0, base) if r is None else (1, r[1], base)

    def evict(self, n: int) -> list[bytes]:
        victims = sorted(self.present, key=self.rank)[:n]
        for h in victims:
            self.pinned_evictions += h in self.held
            self.present.remove(h)
            self.first.pop(h, None)
            self.count.pop(h, None)
        return victims

    def retain(self, h: bytes, until: float, prio: int) -> None:
        if until <= self.now:
            return
        old = self.held.get(h)
        self.held[h] = (until, prio) if old is None else (max(old[0], until), max(old[1], prio))

    def advance(self, now: float) -> None:
        if now <= self.now:
            return
        self.now = now
        for h in [h for h, (until, _) in self.held.items() if until <= now]:
            del self.held[h]
            self.expiries += 1


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("fill")),
        st.tuples(st.just("reuse"), st.integers(0, 9)),
        st.tuples(st.just("touch"), st.integers(0, 9)),
        st.tuples(st.just("retain"), st.integers(0, 9), st.sampled_from([1.0, 5.0, math.inf]), st.integers(0, 3)),
        st.tuples(st.just("retain"), st.integers(0, 9), st.sampled_from([1.0, 5.0, math.inf]), st.integers(0, 3)),
        st.tuples(st.just("unpin"), st.integers(0, 9)),
        st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 6.0])),
        st.tuples(st.just("burst"), st.integers(1, NUM_BLOCKS)),
    ),
    max_size=60,
)


def _run(policy: str, ops: list) -> None:
    pool = BlockPool(NUM_BLOCKS, 4, policy, record_events=True)
    table = table_of(pool)
    model = Model(policy)
    hashes: list[bytes] = []
    now = 0.0
    table.advance(now)
    model.advance(now)

    for op in [("fill",)] * NUM_BLOCKS + ops:  # from a full pool: every later fill evicts
        kind = op[0]
        if kind == "fill":  # a one-block sequence computes a new block, ends: it stays cached
            need = max(0, 1 - (pool.num_free - pool.num_cached_evictable))
            want = model.evict(need) if need else []
            (b,) = pool.allocate(1, 4)
            h = len(hashes).to_bytes(4, "big")
            hashes.append(h)
            pool.register(b, h)
            pool.release([b])
            model.insert(h)
            assert pool.drain_events().evicted == want
        elif kind in ("reuse", "touch") and hashes:
            h = hashes[-1 - op[1] % len(hashes)]
            b = pool.lookup(h)
            if b is None:
                continue
            if kind == "reuse":  # a later request hits it, ends: in use, then evictable again
                pool.incref_all([b])
                pool.release([b])
                model.present.discard(h)
                model.insert(h)
            else:
                pool.touch(b)
                model.touch(h)
        elif kind == "retain" and hashes:
            h = hashes[-1 - op[1] % len(hashes)]
            table.retain([h], Retention(now + op[2], op[3]))
            model.retain(h, now + op[2], op[3])
        elif kind == "unpin" and hashes:
            h = hashes[-1 - op[1] % len(hashes)]
            table.release([h])
            model.held.pop(h, None)
        elif kind == "advance":
            now += op[1]
            table.advance(now)
            model.advance(now)
        elif kind == "burst":  # a request needs n blocks now: evicts past the free list
            n = op[1]
            need = max(0, n - (pool.num_free - pool.num_cached_evictable))
            want = model.evict(need) if need else []
            blocks = pool.allocate(n)
            pool.release(blocks)
            assert pool.drain_events().evicted == want
        assert table.num_ttl_expiries == model.expiries
        assert table.num_pinned_evictions == model.pinned_evictions
        assert pool.num_cached_evictable == len(model.present)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(["lru", "lfu", "fifo"]), OPS)
def test_eviction_matches_the_brute_force_retention_rule(policy, ops):
    _run(policy, ops)


def _filled(policy: str = "lru", n: int = 4) -> tuple[BlockPool, list[bytes]]:
    pool = BlockPool(n, 4, policy, record_events=True)
    hashes = []
    for i in range(n):
        (b,) = pool.allocate(1, 4)
        hashes.append(bytes([i]))
        pool.register(b, hashes[-1])
        pool.release([b])
    pool.drain_events()
    return pool, hashes


def test_a_pinned_block_outlives_newer_unpinned_ones_and_goes_only_when_nothing_else_can():
    pool, h = _filled()
    table = table_of(pool)
    table.retain([h[0]], Retention(math.inf, 0))  # the oldest: LRU's first victim without the pin
    pool.allocate(3)
    assert pool.drain_events().evicted == [h[1], h[2], h[3]]
    assert table.num_pinned_evictions == 0
    assert pool.lookup(h[0]) is not None
    pool.allocate(1)  # nothing else is evictable: the pin gives way, counted
    assert pool.drain_events().evicted == [h[0]]
    assert table.num_pinned_evictions == 1


def test_lower_priority_pins_go_before_higher_ones():
    pool, h = _filled()
    table = table_of(pool)
    table.retain([h[0]], Retention(math.inf, 5))
    table.retain([h[1]], Retention(math.inf, 1))
    table.retain([h[2]], Retention(math.inf, 3))
    pool.allocate(4)
    assert pool.drain_events().evicted == [h[3], h[1], h[2], h[0]]
    assert table.num_pinned_evictions == 3


def test_ttl_expiry_is_lazy_counted_and_the_block_rejoins_its_policy_place():
    pool, h = _filled()
    table = table_of(pool)
    table.advance(100.0)
    table.retain([h[0]], Retention(100.0 + 300, 0))
    table.advance(399.0)
    assert len(table) == 1 and table.num_ttl_expiries == 0
    table.advance(400.0)  # the deadline reached: the entry lapses now, not before
    assert len(table) == 0 and table.num_ttl_expiries == 1
    pool.allocate(1)
    assert pool.drain_events().evicted == [h[0]]  # still LRU's oldest: first again
    assert table.num_pinned_evictions == 0


def test_an_unpinned_block_is_plain_again_and_a_pin_set_before_registration_holds():
    pool, h = _filled()
    table = table_of(pool)
    table.retain([h[0], b"later"], Retention(math.inf, 0))
    assert table.release([h[0]]) == 1
    pool.release(pool.allocate(1))
    assert pool.drain_events().evicted == [h[0]]
    (b,) = pool.allocate(1, 4)  # b"later" computed now: pinned as it registers
    pool.register(b, b"later")
    pool.release([b])
    pool.allocate(3)
    assert pool.drain_events().evicted == [h[1], h[2], h[3]]


def test_without_retention_the_pool_keeps_no_table_and_evicts_as_before():
    pool, h = _filled()
    assert pool.retention is None
    pool.allocate(2)
    assert pool.drain_events().evicted == [h[0], h[1]]
    assert pinned_blocks(pool) == 0


def test_an_empty_table_evicts_exactly_like_no_table():
    for policy in ("lru", "lfu", "fifo"):
        a, ha = _filled(policy)
        b, _ = _filled(policy)
        table_of(b)
        for p in (a, b):
            p.touch(p.lookup(ha[0]))
            p.allocate(3)
        assert a.drain_events().evicted == b.drain_events().evicted


def test_a_request_retains_the_full_blocks_of_its_prefix_per_tenant():
    kv = KVCacheManager(8, 4)
    prompt = list(range(11))  # 2 full blocks and a partial one
    req = RetentionRequest(prefix_tokens=None, ttl_s=60.0, priority=2)
    assert retain_prompt(kv, prompt, "tenant-a", req, now=10.0) == 2
    table = kv.pool.retention
    mine = kv.prompt_hashes(prompt, "tenant-a")
    assert all(table.get(k) == Retention(70.0, 2) for k in mine)
    assert all(table.get(k) is None for k in kv.prompt_hashes(prompt, "tenant-b"))
    assert retain_prompt(kv, prompt, "tenant-a", RetentionRequest(prefix_tokens=7), now=10.0) == 1
    assert release_prompt(kv, prompt, "tenant-b") == 0
    assert release_prompt(kv, prompt, "tenant-a") == 2


def test_a_retention_covers_every_layer_groups_keys():
    kv = KVCacheManager(16, 4, group_windows=(None, 8))
    prompt = list(range(8))
    assert retain_prompt(kv, prompt, None, RetentionRequest(), now=0.0) == 4
    for g in range(2):
        assert all(kv.pool.retention.get(k) for k in kv.group_keys(kv.prompt_hashes(prompt), g))


@pytest.mark.parametrize(("field", "kwargs"), [
    ("ttl", {"ttl_s": 0}), ("ttl", {"ttl_s": -1.0}), ("ttl", {"ttl_s": 1e9}), ("ttl", {"ttl_s": "5m"}),
    ("priority", {"priority": 101}), ("priority", {"priority": -1}), ("priority", {"priority": True}),
    ("prefix_tokens", {"prefix_tokens": -1}), ("prefix_tokens", {"prefix_tokens": 1.5}),
])
def test_a_malformed_retention_is_refused_by_name(field, kwargs):
    with pytest.raises(InvalidRequest) as e:
        RetentionRequest(**kwargs)
    assert e.value.param == field


POLICY_OPS = st.lists(st.tuples(st.sampled_from(["insert", "touch", "remove", "pop"]), st.integers(0, 6)),
                      max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["lru", "lfu", "fifo"]), st.sampled_from([None, 7]), POLICY_OPS)
def test_a_policys_iter_order_is_its_pop_order(name, num_keys, ops):
    from kvpool.core.policies import make_policy

    pol = make_policy(name, num_keys)
    for op, k in ops:
        if op == "insert":
            pol.insert(k)
        elif op == "touch" and k in pol:
            pol.touch(k)
        elif op == "remove" and k in pol:
            pol.remove(k)
        elif op == "pop" and len(pol):
            pol.pop_victim()
    order = list(pol.iter_order())
    assert order == [pol.pop_victim() for _ in range(len(pol))]


def test_a_second_retention_of_a_block_keeps_the_later_deadline_and_higher_priority():
    table = table_of(BlockPool(2, 4))
    table.advance(0.0)
    table.retain([b"k"], Retention(100.0, 3))
    table.retain([b"k"], Retention(50.0, 1))
    assert table.get(b"k") == Retention(100.0, 3)
    table.retain([b"k"], Retention(200.0, 0))
    table.advance(150.0)  # the first deadline passed: the extended retention holds
    assert table.get(b"k") == Retention(200.0, 3) and table.num_ttl_expiries == 0
    assert table.retain([b"k2"], Retention(150.0, 0)) == 0  # already expired: not held
