"""Where each prompt token's KV came from, and why each computed one was not reused.

A prompt of L tokens splits into: the device prefix hit, each store tier's hit, and misses by
reason. Hits are whole blocks from block 0 on; a hit never reaches past block (L-1)//B (a prompt
always computes its last token), so the tokens from there on are `partial_block` (the trailing
partial block, or the last block of a prompt that ends on a block boundary). Every other computed
block gets its own reason, decided from what this server saw before:
- `evicted_<where>`: its identity (the salted chained hash) was registered on the device earlier
  and is gone: from the device (`evicted_device`), or, with a store, from the device and the
  store, named by the store's last tier (`evicted_disk`: write-through put it in every tier, and
  the last to lose it was the disk);
- `different_salt`: the same tokens were registered under another identity (another cache_salt
  or tenant, or an adapter that enters the hash the same way): the unsalted chain matches;
- `first_seen`: neither;
- `outside_window`: the block is still cached on the device but a sliding-window layer group no
  longer holds the window a hit there needs (it was freed as it left an earlier sequence's window);
- `integrity`: the store held it, but the block failed its check when read (`load_failed`: it
  was gone when read, the tier failed or the read timed out);
- `load_slower_than_recompute`: the store held it, but the load-or-recompute planner
  (`core/load_plan.py`) estimated that reading it (and the blocks after it) would take longer than
  computing them;
- `uncacheable`: the request reads no cache (prefix caching off, or prompt logprobs need every
  position computed).
A block after the first miss that is still cached on the device inherits the reason of the
missed block before it (it is unreachable because of that one).

What was seen is kept in `RecentHashes`: two rotating Bloom filters of fixed size, so memory stays
bounded (2 x 1 MiB by default) however long the server runs; it remembers at least the last
`capacity` registered blocks and forgets older ones, and a never-seen block reads as seen with
probability below 0.5% at the default sizes (its reason is then `evicted_*` instead of
`first_seen`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.core.hashing import BlockHash, hash_blocks, key_bytes, root_hash

DEVICE = "device"
FIRST_SEEN = "first_seen"
PARTIAL_BLOCK = "partial_block"
DIFFERENT_SALT = "different_salt"
OUTSIDE_WINDOW = "outside_window"
INTEGRITY = "integrity"
LOAD_FAILED = "load_failed"
UNCACHEABLE = "uncacheable"
LOAD_SLOWER = "load_slower_than_recompute"
EVICTED = "evicted_"  # + "device" or the store's last tier


def evicted_from(where: str) -> str:
    return EVICTED + where


class RecentHashes:
    """A bounded record of block identities seen lately: two Bloom filters of `bits` bits; new
    entries go into the younger, and after `capacity` of them the older one is dropped. So every
    one of the last `capacity` entries is found, none older than 2 x `capacity`, and memory is
    2 x `bits` / 8 bytes. The probes are slices of the identity itself (already a BLAKE2 digest)."""

    def __init__(self, capacity: int = 1 << 19, bits: int = 1 << 23, probes: int = 4) -> None:
        if capacity < 1 or bits < 8 or bits & (bits - 1) or probes < 1:
            raise ValueError(f"RecentHashes needs capacity >= 1, bits a power of two >= 8 and probes >= 1, "
                             f"got {capacity}, {bits}, {probes}")
        self.capacity, self.bits, self.probes = capacity, bits, probes
        self._width = bits.bit_length() - 1
        self._young = bytearray(bits // 8)
        self._old = bytearray(bits // 8)
        self._added = 0

    def _positions(self, h: BlockHash) -> list[int]:
        width, mask = self._width, self.bits - 1
        h = key_bytes(h)
        if len(h) * 8 < width * self.probes:
            h = hashlib.blake2b(h, digest_size=16).digest()
        x = int.from_bytes(h, "little")
        return [(x >> (i * width)) & mask for i in range(self.probes)]

    def add_all(self, hashes: Sequence[BlockHash]) -> None:
        young = self._young
        for h in hashes:
            if self._added >= self.capacity:
                self._old, self._young = young, bytearray(self.bits // 8)
                young, self._added = self._young, 0
            for p in self._positions(h):
                young[p >> 3] |= 1 << (p & 7)
            self._added += 1

    def __contains__(self, h: BlockHash) -> bool:
        pos = self._positions(h)
        return any(all(f[p >> 3] >> (p & 7) & 1 for p in pos) for f in (self._young, self._old))


@dataclass(slots=True)
class PromptSources:
    """One prompt's split: `device_blocks` from the device hit, then one store tier per block
    (`store_tiers`), and the computed tokens by reason (`misses`). `hashes` are its full blocks'
    identities and `scope` names its salt (a digest, never the salt): what a request log keeps."""

    prompt_len: int
    block_size: int
    device_blocks: int = 0
    store_tiers: list[str] = field(default_factory=list)
    misses: dict[str, int] = field(default_factory=dict)
    hashes: tuple[BlockHash, ...] = ()
    scope: str | None = None
    short_reason: str = LOAD_FAILED  # why a store load landed short, once one did

    @property
    def sources(self) -> dict[str, int]:
        """Reused tokens by where they came from: the device, then each tier."""
        out = {DEVICE: self.device_blocks * self.block_size} if self.device_blocks else {}
        for tier in self.store_tiers:
            out[tier] = out.get(tier, 0) + self.block_size
        return out

    @property
    def reused_tokens(self) -> int:
        return (self.device_blocks + len(self.store_tiers)) * self.block_size

    def miss(self, reason: str, tokens: int) -> None:
        if tokens:
            self.misses[reason] = self.misses.get(reason, 0) + tokens

    def settle(self, hit_blocks: int) -> None:
        """The store hit ended at block `hit_blocks` (a load landed short): the blocks planned
        past it are computed, for the reason the short load gave."""
        keep = max(0, hit_blocks - self.device_blocks)
        lost = len(self.store_tiers) - keep
        if lost > 0:
            del self.store_tiers[keep:]
            self.miss(self.short_reason, lost * self.block_size)


def salt_scope(salt: str | None) -> str | None:
    """A stable name of a salt that does not reveal it (the tenant scope of a request log)."""
    return None if salt is None else hashlib.blake2b(salt.encode(), digest_size=8, person=b"kvpool-scope").hexdigest()


class MissLedger:
    """What the device registered (salted and unsalted identities), and the reasons it gives a
    new prompt's blocks. `on_device(h)`: whether block `h` is cached on the device now;
    `store_tiers`: the store's tier names, fastest first (empty: no store); `tiers_of(hashes)`:
    the tier that holds each of a store hit's blocks."""

    def __init__(self, block_size: int, namespace: str, on_device: Callable[[BlockHash], object],
                 windowed: bool = False, store_tiers: Sequence[str] = (),
                 tiers_of: Callable[[Sequence[BlockHash]], list[str]] | None = None,
                 capacity: int = 1 << 19) -> None:
        self.block_size = block_size
        self._root = root_hash(namespace)
        self._on_device = on_device
        self.windowed = windowed
        self.store_tiers = tuple(store_tiers)
        self._tiers_of = tiers_of
        self._evicted = evicted_from(self.store_tiers[-1] if self.store_tiers else DEVICE)
        self.seen = RecentHashes(capacity)
        self.unsalted = RecentHashes(capacity)

    @classmethod
    def of(cls, kv, store_tiers: Sequence[str] = (),
           tiers_of: Callable[[Sequence[BlockHash]], list[str]] | None = None) -> MissLedger:
        """A ledger for the KV manager `kv` (kvpool.core.kv_manager.KVCacheManager), to set as its
        `ledger`, with the store's tiers (if any)."""
        return cls(kv.block_size, kv.namespace, kv.pool.lookup, kv.windowed, store_tiers, tiers_of)

    def saw(self, hashes: Sequence[BlockHash], token_ids: Sequence[int], salted: bool, start: int) -> None:
        """Blocks `start..start+len(hashes)` of a sequence were registered on the device; `salted`:
        their identities carry extra keys (a cache_salt), so the unsalted chain is recorded too."""
        self.seen.add_all(hashes)
        if salted:
            plain = hash_blocks(token_ids, self.block_size, parent=self._root, limit=start + len(hashes))
            self.unsalted.add_all(plain[start:])
        else:
            self.unsalted.add_all(hashes)

    def explain(self, token_ids: Sequence[int], salt: str | None, hashes: Sequence[BlockHash],
                hit_blocks: int, store_blocks: int, reusable: bool = True,
                slower_blocks: int = 0) -> PromptSources:
        """The split of a prompt admitted with a device hit of `hit_blocks` and `store_blocks`
        more planned from the store (`hashes`: its full blocks' identities), and the
        `slower_blocks` after those that the store held but the planner chose to compute."""
        B, L = self.block_size, len(token_ids)
        out = PromptSources(L, B, hashes=tuple(hashes), scope=salt_scope(salt))
        if not reusable:
            out.miss(UNCACHEABLE, L)
            return out
        out.device_blocks = hit_blocks
        if store_blocks:
            keys = hashes[hit_blocks : hit_blocks + store_blocks]
            out.store_tiers = list(self._tiers_of(keys)) if self._tiers_of else ["store"] * store_blocks
        limit = min((L - 1) // B, len(hashes))
        out.miss(PARTIAL_BLOCK, L - limit * B)
        start = hit_blocks + store_blocks
        slower = max(0, min(slower_blocks, limit - start))
        out.miss(LOAD_SLOWER, slower * B)
        start += slower
        plain: list[BlockHash] | None = None
        last: str | None = None
        for i in range(start, limit):
            h = hashes[i]
            if self._on_device(h) is not None:
                reason = last or (OUTSIDE_WINDOW if self.windowed else FIRST_SEEN)
            elif h in self.seen:
                reason = last = self._evicted
            else:
                if plain is None:
                    plain = hash_blocks(token_ids, B, parent=self._root, limit=limit)
                reason = last = DIFFERENT_SALT if plain[i] in self.unsalted else FIRST_SEEN
            out.miss(reason, B)
        return out
