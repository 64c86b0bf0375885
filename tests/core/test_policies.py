"""Eviction order of each policy, checked against a brute-force reference."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.policies import make_policy

OPS = st.lists(st.tuples(st.sampled_from(["insert", "touch", "remove", "pop"]), st.integers(0, 6)), max_size=60)


class Reference:
    """The same semantics, written the slow obvious way."""

    def __init__(self, name: str) -> None:
        self.name, self.clock = name, 0
        self.present: set = set()
        self.first: dict = {}  # FIFO: first insertion time, kept until evicted
        self.last: dict = {}  # LRU: last insert/touch time
        self.count: dict = {}  # LFU: accesses since first insertion, kept until evicted

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def insert(self, k):
        if k in self.present:
            self.touch(k)
            return
        self.present.add(k)
        self.first.setdefault(k, self.tick())
        self.last[k] = self.tick()
        self.count[k] = self.count.get(k, 0) + 1

    def touch(self, k):
        self.last[k] = self.tick()
        self.count[k] += 1

    def remove(self, k):
        self.present.remove(k)

    def pop(self):
        if self.name == "fifo":
            k = min(self.present, key=lambda x: self.first[x])
        elif self.name == "lru":
            k = min(self.present, key=lambda x: self.last[x])
        else:
            k = min(self.present, key=lambda x: (self.count[x], self.last[x]))
        self.present.remove(k)
        self.first.pop(k, None)
        self.count.pop(k, None)
        return k


def _check(name, ops, num_keys=None):
    pol, ref = make_policy(name, num_keys), Reference(name)
    for op, k in ops:
        if op == "insert":
            if name == "fifo" and k in ref.present:
                continue  # FIFO ignores a repeated insert; the reference would count it
            pol.insert(k)
            ref.insert(k)
        elif op == "touch" and k in ref.present:
            if name != "fifo":
                pol.touch(k)
                ref.touch(k)
        elif op == "remove" and k in ref.present:
            pol.remove(k)
            ref.remove(k)
        elif op == "pop" and ref.present:
            assert pol.pop_victim() == ref.pop()
        assert len(pol) == len(ref.present)


@settings(max_examples=300)
@given(OPS, st.sampled_from([None, 7]))
def test_lru_evicts_least_recently_used(ops, num_keys):
    _check("lru", ops, num_keys)  # num_keys: the block-id form a pool builds (a list, not a dict)


def test_lru_stays_exact_over_a_long_run_that_compacts_its_log():
    """Thousands of operations: the log of stale entries is compacted many times over."""
    rng = random.Random(0)
    ops = [(rng.choice(["insert", "insert", "touch", "remove", "pop"]), rng.randrange(40)) for _ in range(20000)]
    for num_keys in (None, 40):
        _check("lru", ops, num_keys)


@settings(max_examples=300)
@given(OPS)
def test_lfu_evicts_least_frequently_used_then_oldest(ops):
    _check("lfu", ops)


@settings(max_examples=300)
@given(OPS)
def test_fifo_keeps_first_insertion_order_across_reuse(ops):
    _check("fifo", ops)


def test_fifo_differs_from_lru_when_a_block_is_reused():
    fifo, lru = make_policy("fifo"), make_policy("lru")
    for p in (fifo, lru):
        p.insert("a")
        p.insert("b")
        p.remove("a")  # "a" is reused by a request...
        p.insert("a")  # ...and freed again
    assert fifo.pop_victim() == "a"
    assert lru.pop_victim() == "b"


BATCHES = st.lists(
    st.tuples(st.sampled_from(["insert", "remove", "pop"]), st.lists(st.integers(0, 9), max_size=6)), max_size=30
)


@settings(max_examples=200)
@given(st.sampled_from(["lru", "lfu", "fifo"]), st.sampled_from([None, 10]), BATCHES)
def test_batch_operations_equal_their_single_operations_in_order(name, num_keys, batches):
    batched, single = make_policy(name, num_keys), make_policy(name)
    for op, keys in batches:
        if op == "insert":
            batched.insert_many(keys)
            for k in keys:
                single.insert(k)
        elif op == "remove":
            keys = [k for k in dict.fromkeys(keys) if k in single]
            batched.remove_many(keys)
            for k in keys:
                single.remove(k)
        else:
            n = min(len(keys), len(single))
            assert batched.pop_victims(n) == [single.pop_victim() for _ in range(n)]
        assert len(batched) == len(single)
    assert batched.pop_victims(len(single)) == [single.pop_victim() for _ in range(len(single))]


@settings(max_examples=200)
@given(st.sampled_from(["lru", "lfu", "fifo"]), st.sampled_from([None, 10]), BATCHES)
def test_inserting_keys_known_new_equals_insert_many(name, num_keys, batches):
    """A pool releases blocks that were in use (none evictable, each once): `insert_new` skips
    the checks and leaves the same order and size as `insert_many`."""
    fast, checked = make_policy(name, num_keys), make_policy(name, num_keys)
    for op, keys in batches:
        if op == "insert":
            keys = [k for k in dict.fromkeys(keys) if k not in checked]
            fast.insert_new(keys)
            checked.insert_many(keys)
        elif op == "remove":
            keys = [k for k in dict.fromkeys(keys) if k in checked]
            fast.remove_many(keys)
            checked.remove_many(keys)
        else:
            n = min(len(keys), len(checked))
            assert fast.pop_victims(n) == checked.pop_victims(n)
        assert len(fast) == len(checked)
    assert fast.pop_victims(len(checked)) == checked.pop_victims(len(checked))
