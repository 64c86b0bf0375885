"""Retention in the host and disk tiers (issue 32, item 1): the device pool's rule, per tier.

A tier evicts first the blocks without a live retention, in its own policy's order, then the
retained ones, lower priority first (the policy's order among equals), as kvpool/core/retention.py
does for device blocks; a retained victim counts in the tier's `pinned_evictions`. The retentions
are the device pool's `RetentionTable`, which only the engine thread changes: the store's worker
threads read it one entry at a time (`get`, one dict read) and its `now` once per eviction, and
never iterate it. A store key is the store's prefix, maybe a quantization, then the block hash in
hex: the table's key. With no table, or an empty one, a tier pops its policy's victims as before.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.core.policies import EvictionPolicy
from kvpool.core.retention import Retention, RetentionTable, eviction_order, take_out
from kvpool.store.tier import StoreKey

RetainedOf = Callable[[StoreKey], Retention | None]


class TierRetention:
    """The live retention of a tier's keys, read from the table `source()` returns (the device
    pool's, which exists only once something was retained); keys without `prefix` (another
    namespace's or format's, left on a disk) are never retained."""

    def __init__(self, source: Callable[[], RetentionTable | None], prefix: str) -> None:
        self._source = source
        self._prefix = prefix

    def lookup(self) -> RetainedOf | None:
        """A key's live retention as of now, or None when nothing is retained (then a tier
        evicts exactly as without retention)."""
        table = self._source()
        if table is None or not len(table):
            return None
        get, now, prefix = table.get, table.now, self._prefix

        def retained(key: StoreKey) -> Retention | None:
            if not key.startswith(prefix):
                return None
            try:
                r = get(bytes.fromhex(key.rsplit(":", 1)[-1]))
            except ValueError:
                return None
            return r if r is not None and r.until > now else None

        return retained


def take_victims(policy: EvictionPolicy, over: int, size_of: Callable[[StoreKey], int],
                 retained: RetainedOf | None) -> tuple[list[StoreKey], int]:
    """Victims whose sizes add up to at least `over` bytes (every key if they never do), taken
    out of `policy` as its own eviction would, and how many of them were retained. Without
    `retained`: the policy's `pop_victim`s, exactly as a tier without retention."""
    victims: list[StoreKey] = []
    if retained is None:
        while over > 0 and len(policy):
            key = policy.pop_victim()
            victims.append(key)
            over -= size_of(key)  # type: ignore[arg-type]
        return victims, 0
    forced = 0
    for key, kept in eviction_order(policy, retained):
        if over <= 0:
            break
        victims.append(key)
        over -= size_of(key)
        forced += kept
    take_out(policy, victims)
    return victims, forced
