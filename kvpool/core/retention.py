"""Retention: which cached blocks a pool keeps longest (issue 32, item 1).

A block's retention is (until, priority), held by its content (block hash, so per tenant: the
salt enters the first block's hash) in a `RetentionTable`, whether or not the block is cached
now: a prefix pinned before it is computed, or recomputed after a forced eviction, is pinned
again when it registers. A retention is live while `now < until` (`until` may be infinite:
pinned until unpinned). Eviction among the evictable (ref count 0, cached) blocks:

  1. blocks without a live retention (never retained, expired, unpinned) first, in the pool's
     own LRU / LFU / FIFO order;
  2. then the retained ones, lower priority first, the policy's order among equals.

Evicting a block of step 2 is a pinned eviction (`num_pinned_evictions`): it happens only when
nothing else could go. Expiry is lazy: `advance(now)` (the driver's time, passed through the
scheduler) drops the entries whose time has come and counts them (`num_ttl_expiries`). With an
empty table the pool runs exactly the code of before; the order among unretained blocks is the
policy's order whatever the table holds (retained blocks keep their place in it, skipped).
A pool that records KV events reports retention in them (`published`, for the conductor's
index: conductor/index.py). Pure: no clock, the time always comes in as an argument.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvpool.core.hashing import BlockHash
from kvpool.core.policies import EvictionPolicy
from kvpool.errors import InvalidRequest

MIN_PRIORITY, MAX_PRIORITY = 0, 100
MAX_TTL_S = 7 * 24 * 3600.0  # a week; longer is a pin (ttl None) that an operator unpins


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep a block cached until `until` (driver time; inf: until unpinned), ranked by
    `priority` against other retained blocks (higher stays longer)."""

    until: float
    priority: int = 0


@dataclass(frozen=True, slots=True)
class RetentionRequest:
    """What a request asks: keep the full blocks of its first `prefix_tokens` prompt tokens
    (None: the whole prompt) for `ttl_s` seconds from its arrival (None: until unpinned)."""

    prefix_tokens: int | None = None
    ttl_s: float | None = 300.0
    priority: int = 0

    def __post_init__(self) -> None:
        check_retention(self.ttl_s, self.priority)
        p = self.prefix_tokens
        if p is not None and (not isinstance(p, int) or isinstance(p, bool) or p < 0):
            raise InvalidRequest(f"retention prefix_tokens must be an integer >= 0, got {p!r}", param="prefix_tokens")

    def retention(self, now: float) -> Retention:
        return Retention(math.inf if self.ttl_s is None else now + self.ttl_s, self.priority)


def check_retention(ttl_s: float | None, priority: int, param: str = "ttl") -> None:
    """Refuse a TTL outside (0, MAX_TTL_S] or a priority outside the range, by name."""
    if ttl_s is not None and (
        isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not 0 < ttl_s <= MAX_TTL_S
    ):
        raise InvalidRequest(f"{param} must be a duration in (0, {MAX_TTL_S:g}] seconds, got {ttl_s!r}", param=param)
    if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRequest(f"priority must be an integer in {MIN_PRIORITY}..{MAX_PRIORITY}, got {priority!r}",
                             param="priority")


class RetentionTable:
    """Live retentions by block hash, the time they are read against, and the counters."""

    def __init__(self) -> None:
        self._held: dict[BlockHash, Retention] = {}
        self._deadlines: list[tuple[float, BlockHash]] = []  # lazy: an entry may be stale
        self.now = -math.inf
        self.num_ttl_expiries = 0
        self.num_pinned_evictions = 0
        # keys retained or released since the last `published` (None: the pool records no KV events)
        self.changed: set[BlockHash] | None = None

    def __len__(self) -> int:
        return len(self._held)

    def get(self, key: BlockHash) -> Retention | None:
        return self._held.get(key)

    def advance(self, now: float) -> None:
        """The driver's time is `now` (never goes back): drop and count what expired."""
        if now <= self.now:
            return
        self.now = now
        deadlines, held = self._deadlines, self._held
        while deadlines and deadlines[0][0] <= now:
            until, key = heapq.heappop(deadlines)
            r = held.get(key)
            if r is not None and r.until == until:
                del held[key]
                self.num_ttl_expiries += 1

    def retain(self, keys: Iterable[BlockHash], retention: Retention) -> int:
        """Merge `retention` into each key's (the later `until`, the higher priority; an
        expired one is not added). Returns how many keys it now holds."""
        if retention.until <= self.now:
            return 0
        held, n = self._held, 0
        for key in keys:
            old = held.get(key)
            new = retention if old is None else Retention(max(old.until, retention.until),
                                                          max(old.priority, retention.priority))
            if new != old:
                held[key] = new
                if self.changed is not None:
                    self.changed.add(key)
                if math.isfinite(new.until) and (old is None or new.until != old.until):
                    heapq.heappush(self._deadlines, (new.until, key))
            n += 1
        return n

    def release(self, keys: Iterable[BlockHash]) -> int:
        """Drop the keys' retention (unpin); returns how many had one."""
        held, changed = self._held, self.changed
        dropped = [k for k in keys if held.pop(k, None) is not None]
        if changed is not None:
            changed.update(dropped)
        return len(dropped)

    def published(self, stored: Iterable[BlockHash],
                  cached: Callable[[BlockHash], int | None]) -> dict[BlockHash, Retention | None]:
        """What a KV event reports of retention: the live retention of each newly `stored` block
        that has one, and of each block retained or released since the last call that is
        `cached` now (None: released). Expiries are not reported: a reader expires `until`
        against its own clock, so a consumer never counts on a retention the pool has dropped."""
        held = self._held
        out: dict[BlockHash, Retention | None] = {h: held[h] for h in stored if h in held}
        if self.changed:
            out.update((h, held.get(h)) for h in self.changed if cached(h) is not None)
            self.changed = set()
        return out

    def held_keys(self) -> list[BlockHash]:
        """The hashes holding a live retention (as of the last `advance`)."""
        return list(self._held)

    def pick(self, policy: EvictionPolicy, n: int, hashes: Sequence[BlockHash | None]) -> list[Hashable] | None:
        """The `n` victims (block ids, `hashes[b]` their hash) by the rule above, taken out of
        `policy` as its own eviction would; None when no block is retained (the caller pops the
        policy's victims itself, exactly as without retention)."""
        if not self._held:
            return None
        held = self._held
        victims: list[Hashable] = []
        forced = 0
        for key, kept in eviction_order(policy, lambda key: held.get(hashes[key])):  # type: ignore[index]
            if len(victims) == n:
                break
            victims.append(key)
            forced += kept
        self.num_pinned_evictions += forced
        if len(victims) < n:
            raise KeyError(f"{n} victims wanted, {len(victims)} evictable")
        take_out(policy, victims)
        return victims


def eviction_order(policy: EvictionPolicy,
                   retained: Callable[[Hashable], Retention | None]) -> Iterator[tuple[Hashable, bool]]:
    """The policy's keys in the order the rule evicts them, each with whether it is retained
    (`retained(key)`: its live retention or None): lazily, so a caller that finds its victims
    among the unretained never sorts the retained. The policy must not change meanwhile."""
    kept: list[tuple[int, int, Hashable]] = []  # (priority, position, key) of retained keys
    for key in policy.iter_order():  # type: ignore[attr-defined]
        r = retained(key)
        if r is None:
            yield key, False
        else:
            kept.append((r.priority, len(kept), key))
    kept.sort()
    for _, _, key in kept:
        yield key, True


def take_out(policy: EvictionPolicy, victims: list[Hashable]) -> None:
    """Remove evicted keys from `policy` as its own eviction would (LFU / FIFO forget a key's
    count / place)."""
    forget = getattr(policy, "forget", None)
    if forget is None:
        policy.remove_many(victims)
    else:
        for key in victims:
            forget(key)


def prefix_keys(group_keys, hashes: Sequence[BlockHash], num_groups: int) -> list[BlockHash]:
    """Every layer group's keys of the blocks `hashes` (group g > 0 registers under its own)."""
    out = list(hashes)
    for g in range(1, num_groups):
        out += group_keys(hashes, g)
    return out


def table_of(pool) -> RetentionTable:
    """The pool's retention table, made on first use (a pool that never retains keeps None:
    its eviction runs exactly as without retention)."""
    if pool.retention is None:
        pool.retention = RetentionTable()
        if pool.events is not None:  # KV events carry retention changes (`published`)
            pool.retention.changed = set()
    return pool.retention


def prefix_hashes(kv, token_ids: Sequence[int], cache_salt: str | None, num_tokens: int | None) -> list[BlockHash]:
    """Every layer group's keys of the full blocks within the first `num_tokens` tokens (None:
    all) of a prompt under `cache_salt` (the tenant's), as `kv` (a KVCacheManager) hashes them."""
    n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    full = n // kv.block_size
    if full == 0:
        return []
    return prefix_keys(kv.group_keys, kv.prompt_hashes(token_ids, cache_salt, limit=full), kv.num_groups)


def prefix_blocks(prefix_tokens: int | None, full_blocks: int, block_size: int) -> int:
    """How many of a prompt's `full_blocks` blocks of `block_size` tokens lie within its first
    `prefix_tokens` tokens (None: all): what a retention (or an unpin) covers."""
    return full_blocks if prefix_tokens is None else min(full_blocks, prefix_tokens // block_size)


def retain_hashes(kv, hashes: Sequence[BlockHash], request: RetentionRequest, now: float) -> int:
    """Apply a request's retention, from `now` (its arrival), to the blocks it covers among a
    prompt's full blocks `hashes` (group 0's chained hashes, as admission uses them; `kv` a
    KVCacheManager); returns how many keys it holds (blocks per layer group)."""
    table = table_of(kv.pool)
    table.advance(now)
    n = prefix_blocks(request.prefix_tokens, len(hashes), kv.block_size)
    return table.retain(prefix_keys(kv.group_keys, hashes[:n], kv.num_groups), request.retention(now))


def retain_prompt(kv, token_ids: Sequence[int], cache_salt: str | None, request: RetentionRequest,
                  now: float) -> int:
    """`retain_hashes` for a prompt given as token ids under `cache_salt` (a pin)."""
    return retain_hashes(kv, kv.prompt_hashes(token_ids, cache_salt), request, now)


def release_prompt(kv, token_ids: Sequence[int], cache_salt: str | None, num_tokens: int | None = None) -> int:
    """Unpin the prompt's blocks (one tenant's: its salt is in the hashes); how many were held."""
    if kv.pool.retention is None:
        return 0
    return kv.pool.retention.release(prefix_hashes(kv, token_ids, cache_salt, num_tokens))


def pinned_blocks(pool) -> int:
    """Cached device blocks (in use or not) holding a live retention: the pinned-bytes gauge's count."""
    ret = pool.retention
    if ret is None or not len(ret):
        return 0
    return sum(pool.lookup(k) is not None for k in ret.held_keys())
