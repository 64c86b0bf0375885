"""The tiered KV store: lookup / load / save of KV blocks by chained hash across tiers.

Tiers are ordered fastest first (host, disk, remote). A request can reuse the longest run
of blocks present from its first block, each block from whichever tier has it. Loads
promote blocks into the first tier. Write-through saves to every tier; write-back saves
to the first tier only and each tier demotes its evicted blocks to the next one. Each tier
may pack blocks with its own codec (codec.py); a block moving between tiers is re-packed.
A tier with a lossy codec (int8 / int4) keeps its blocks under keys of their own
(`kv3:<ns>:int4:<hash>`) and its reads accept only that quantization (or exact blocks), and a
quantized block never moves into a tier of another scheme: exact KV is never mixed with an
approximation of it, in one server or between servers sharing a pool.

Nothing a tier holds can break a request: `lookup` and `load` never raise. A value that
fails to decode (truncated, bit-flipped, another model's, another block's, an old format)
is a miss, counted by reason in that tier's `bad_entries`, and deleted from the tier that
served it; a tier that raises is counted as an error and skipped.

Every read that returns bytes updates that tier's online read estimate (seconds against bytes:
the read and its checks, what a load costs the engine; `read_costs`), which the load-or-recompute
planner prices a hit with (kvpool/core/load_plan.py).

`follow_retention` points every tier at the device pool's retention table: the host and disk
tiers evict pinned / TTL'd / high-priority blocks last, as the device does (retained.py); Redis
and Mooncake, which evict by their own policy in another process, are told through it (key
expiries, soft pins: remote_redis.py, remote_mooncake.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from kvpool.core.hashing import BlockHash
from kvpool.core.kv_groups import GROUP_TAG_BYTES
from kvpool.core.load_plan import LinearEstimate, ReadCost
from kvpool.core.retention import RetentionTable
from kvpool.errors import ConfigError
from kvpool.store.codec import BY_ID, get_codec, scheme
from kvpool.store.format import (
    FORMAT_VERSION,
    CheckedBlock,
    CorruptBlock,
    block_codec_id,
    check_block,
    decode_block,
    encode_block,
    max_encoded_size,
)
from kvpool.store.layered import LayeredBlock, open_layered
from kvpool.store.retained import TierRetention
from kvpool.store.tier import RangeReads, StoreKey, Tier, TierStats

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write-through", "write-back")


def namespace_id(namespace: str) -> str:
    """Short fixed-length tag of a namespace, used in keys (the full name is in each header)."""
    return hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()


class TieredKVStore:
    """Blocks of one namespace (model, dtype, layout) across `tiers`, fastest first.

    `codecs` maps tier names to codec names (codec.CODECS); unnamed tiers store raw bytes. A
    lossy codec needs float blocks `[layers, 2, block_size, heads, head_dim]`."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        namespace: str,
        block_shape: tuple[int, ...],
        dtype: np.dtype | str,
        write_policy: str = "write-through",
        workers: int = 2,
        codecs: Mapping[str, str] | None = None,
    ) -> None:
        if not tiers:
            raise ConfigError("a tiered KV store needs at least one tier, got 0")
        if write_policy not in WRITE_POLICIES:
            raise ConfigError(f"unknown write policy {write_policy!r}; choose one of {WRITE_POLICIES}")
        if workers < 1:
            raise ConfigError(f"store workers must be at least 1, got {workers}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        codecs = dict(codecs or {})
        unknown = sorted(set(codecs) - set(names))
        if unknown:
            raise ConfigError(f"codec given for tiers {unknown}, which this store does not have ({names})")
        self.codecs = {name: get_codec(codecs.get(name, "none"), f"{name} tier codec").name for name in names}
        for name, codec in self.codecs.items():
            quant = get_codec(codec).quant
            if quant is not None:
                try:
                    quant.check_shape(tuple(block_shape), dtype)
                except ConfigError as exc:
                    raise ConfigError(f"{name} tier codec {codec!r}: {exc}") from None
        self._scheme = {name: scheme(get_codec(codec)) for name, codec in self.codecs.items()}
        self.lossy_loads: dict[str, int] = dict.fromkeys(names, 0)  # blocks served quantized, per tier
        self.tiers = list(tiers)
        self.namespace = namespace
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        self.write_policy = write_policy
        self._bad: dict[str, dict[str, int]] = {name: {} for name in names}
        self._raised: dict[str, int] = dict.fromkeys(names, 0)
        self.recent_corrupt: set[BlockHash] = set()  # blocks that failed a check lately (cleared at 4096)
        # The format version is in the key, so servers of two versions sharing a pool never
        # read (and delete) each other's blocks.
        self._prefix = f"kv{FORMAT_VERSION}:{namespace_id(namespace)}:"
        # the longest identity: a chained hash tagged with its layer group
        limit = max_encoded_size(namespace, bytes(16 + GROUP_TAG_BYTES), self.block_shape, self.dtype)
        for tier in self.tiers:
            tier.max_value_bytes = limit
        self._reads = {name: LinearEstimate() for name in names}
        self._read_at: dict[str, float] = {}  # tier -> time.monotonic() of its last measured read
        self._read_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore")
        self._pending: set[Future] = set()  # saves and promotions
        if write_policy == "write-back":
            for upper, lower in zip(self.tiers, self.tiers[1:], strict=False):
                if hasattr(upper, "on_evict"):
                    upper.on_evict = self._demoter(lower)

    def key(self, block_hash: BlockHash, tier: str | None = None) -> StoreKey:
        """The namespaced key of a block in `tier` (default: in the exact tiers); a lossy
        tier's keys name its quantization."""
        quant = self._scheme[tier] if tier is not None else "exact"
        return self._prefix + ("" if quant == "exact" else quant + ":") + block_hash.hex()

    def follow_retention(self, source: Callable[[], RetentionTable | None]) -> None:
        """Give every tier that keeps retention (host and disk evict by it, Redis and Mooncake
        pass it to their pool) the retentions of the table `source()` returns (the device pool's;
        None while nothing was retained). The table is read, never written, from the store's
        workers."""
        for tier in self.tiers:
            if hasattr(tier, "retention"):
                tier.retention = TierRetention(source, self._prefix)

    def lookup(self, hashes: Sequence[BlockHash]) -> tuple[int, list[str]]:
        """Longest run of present blocks from the first, and the fastest tier holding each."""
        keys = {t.name: [self.key(h, t.name) for h in hashes] for t in self.tiers}
        where: list[str] = []
        pos = 0
        while pos < len(hashes):
            for tier in self.tiers:
                run = self._guard(tier, "lookup", tier.lookup, keys[tier.name][pos:]) or 0
                if run:
                    where.extend([tier.name] * run)
                    pos += run
                    break
            else:
                break
        return pos, where

    def load(self, hashes: Sequence[BlockHash], deferred: bool = False,
             layered: Collection[str] = ()) -> list[np.ndarray | CheckedBlock | LayeredBlock]:
        """Blocks of the longest loadable prefix of `hashes` (stops at the first miss).

        Each array has `block_shape` and `dtype` and is read-only; copy it into the KV cache.
        `deferred`: a block whose decoding cannot fail once checked comes back checked but not
        decoded (`CheckedBlock`: `block[l]` decodes layer l), for a reader that decodes layer by
        layer later (the layer-wise load, under the forward). `layered`: the tiers (names) whose
        blocks come back with only their header read and checked (`LayeredBlock`: `block[l]`
        reads and checks layer l; tell the store how it went with `finish_layered` or
        `reject_layered`), tiers that read ranges; a block in another tier as with `deferred`.
        """
        out: list[np.ndarray | CheckedBlock | LayeredBlock] = []
        for h in hashes:
            block = self._load_one(h, deferred or bool(layered), layered)
            if block is None:
                break
            out.append(block)
        return out

    def _load_one(self, block_hash: BlockHash, deferred: bool = False,
                  layered: Collection[str] = ()) -> np.ndarray | CheckedBlock | LayeredBlock | None:
        for i, tier in enumerate(self.tiers):
            key = self.key(block_hash, tier.name)
            if tier.name in layered and isinstance(tier, RangeReads):
                opened = self._open_layered(i, block_hash)
                if opened is not None:
                    return opened
                continue
            start = time.monotonic()
            data = self._guard(tier, "get", tier.get, key)
            if data is None:
                continue
            try:
                checked = check_block(data, self.namespace, self.block_shape, self.dtype, block_hash,
                                      self._scheme[tier.name])
                block = checked if deferred and checked.deferrable else checked.array()
                self._measured(tier.name, len(data), start)
            except CorruptBlock as exc:
                self._reject(tier, block_hash, exc)
                continue
            quant = _data_scheme(data)
            if quant != "exact":
                self.lossy_loads[tier.name] += 1
            if i > 0:
                self._move(self.tiers[0], block_hash, block, data)
            return block
        return None

    def _reject(self, tier: Tier, block_hash: BlockHash, exc: CorruptBlock) -> None:
        """A value under `block_hash`'s key in `tier` failed a check: count it, remember the block
        as corrupt (the miss reason `integrity`), delete it."""
        key = self.key(block_hash, tier.name)
        log.warning("tier %s: dropping unreadable block %s (%s): %s", tier.name, key, exc.reason, exc)
        bad = self._bad[tier.name]
        bad[exc.reason] = bad.get(exc.reason, 0) + 1
        if len(self.recent_corrupt) >= 4096:
            self.recent_corrupt.clear()
        self.recent_corrupt.add(block_hash)
        self._guard(tier, "delete", tier.delete, key)

    def _open_layered(self, index: int, block_hash: BlockHash) -> LayeredBlock | None:
        """Tier `index`'s value of the block with its header and table read and checked (None: a
        miss there; a bad entry is counted and dropped)."""
        tier = self.tiers[index]
        key = self.key(block_hash, tier.name)

        def read(offset: int, length: int) -> tuple[bytes, int] | None:
            return self._guard(tier, "get_range", tier.get_range, key, offset, length)

        try:
            block = open_layered(read, tier.name, index, block_hash, self.namespace, self.block_shape, self.dtype,
                                 self._scheme[tier.name])
        except CorruptBlock as exc:
            self._reject(tier, block_hash, exc)
            return None
        if block is not None and _data_scheme(block.prefix) != "exact":
            self.lossy_loads[tier.name] += 1
        return block

    def finish_layered(self, block: LayeredBlock) -> None:
        """Every layer of `block` was read and passed: measure the read, and promote the block
        into the first tier (on a worker) as a whole-block load does."""
        now = time.monotonic()
        self._measured(block.tier, block.nbytes, now - block.elapsed_s)
        data = block.value()
        if block.tier_index > 0 and data is not None:
            future = self._pool.submit(self._promote, block.block_hash, data, block.tier)
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)

    def reject_layered(self, block: LayeredBlock, exc: Exception) -> None:
        """A layer of `block` failed its check (CorruptBlock: the entry is dropped and counted) or
        could not be read (a miss: nothing to drop)."""
        if isinstance(exc, CorruptBlock):
            self._reject(self.tiers[block.tier_index], block.block_hash, exc)

    def _promote(self, block_hash: BlockHash, data: bytes, tier: str) -> None:
        try:
            block = check_block(data, self.namespace, self.block_shape, self.dtype, block_hash, self._scheme[tier])
        except CorruptBlock as exc:  # it passed layer by layer: only a bug gets here
            log.warning("not promoting block %s read from tier %s: %s", block_hash.hex(), tier, exc)
            return
        self._move(self.tiers[0], block_hash, block, data)

    def _measured(self, tier: str, nbytes: int, start: float) -> None:
        now = time.monotonic()
        with self._read_lock:
            self._reads[tier].update(float(nbytes), now - start)
            self._read_at[tier] = now

    def read_costs(self, max_age_s: float | None = None) -> dict[str, ReadCost]:
        """Each tier's read cost as measured lately; a tier never read (or, with `max_age_s`, not
        read for that long: a slow tier the planner stopped reading gets a fresh try) is left out."""
        now = time.monotonic()
        with self._read_lock:
            out = {}
            for name, est in self._reads.items():
                cost = est.read_cost()
                if cost is not None and (max_age_s is None or now - self._read_at[name] <= max_age_s):
                    out[name] = cost
            return out

    def save(self, block_hash: BlockHash, block: np.ndarray) -> bool:
        """Store one block (`block_shape`, `dtype`); True if at least one tier kept it."""
        if block.shape != self.block_shape or block.dtype != self.dtype:
            raise ConfigError(
                f"block is {block.shape} {block.dtype}, this store holds {self.block_shape} {self.dtype}"
            )
        targets = self.tiers[:1] if self.write_policy == "write-back" else self.tiers
        encoded: dict[str, bytes] = {}
        stored = False
        for tier in targets:
            codec = self.codecs[tier.name]
            if codec not in encoded:
                encoded[codec] = encode_block(self.namespace, block_hash, block, codec)
            stored |= bool(self._guard(tier, "put", tier.put, self.key(block_hash, tier.name), encoded[codec]))
        return stored

    def save_async(self, block_hash: BlockHash, block: np.ndarray) -> Future[bool]:
        """`save` on a worker thread; the block is copied now, so the caller may reuse it."""
        future = self._pool.submit(self.save, block_hash, np.array(block, copy=True))
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def load_async(self, hashes: Sequence[BlockHash], deferred: bool = False,
                   layered: Collection[str] = ()) -> Future[list]:
        """`load` on a worker thread, to overlap the read with compute."""
        return self._pool.submit(self.load, list(hashes), deferred, layered)

    def flush(self) -> None:
        """Wait until every save queued so far has finished."""
        pending, self._pending = self._pending, set()
        wait(pending)

    def stats(self) -> dict[str, TierStats]:
        """Each tier's counters, plus what the store saw of it: undecodable entries in
        `bad_entries`, calls that raised in `errors`."""
        out = {}
        for tier in self.tiers:
            snap = tier.stats()
            snap.lossy_loads = self.lossy_loads[tier.name]
            for reason, n in self._bad[tier.name].items():
                snap.bad_entries[reason] = snap.bad_entries.get(reason, 0) + n
            snap.errors += self._raised[tier.name]
            with self._read_lock:
                cost = self._reads[tier.name].read_cost()
            if cost is not None:
                snap.read_latency_s, snap.read_bandwidth = cost.latency_s, min(cost.bandwidth, 1e15)
            out[tier.name] = snap
        return out

    def close(self) -> None:
        """Finish pending async work, then release every tier."""
        self._pool.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()

    # -- helpers ---------------------------------------------------------------------------
    def _move(self, tier: Tier, block_hash: BlockHash, block: np.ndarray | CheckedBlock, data: bytes) -> None:
        """Put `data` (a valid encoding of `block`) into `tier`: as it is if that is the tier's
        codec, re-packed from exact KV, never from quantized KV (which would be laundered into
        an exact tier, or quantized twice)."""
        codec = self.codecs[tier.name]
        if block_codec_id(data) == get_codec(codec).id:
            packed = data
        elif _data_scheme(data) == "exact":
            packed = encode_block(self.namespace, block_hash, block, codec)
        else:
            return
        self._guard(tier, "put", tier.put, self.key(block_hash, tier.name), packed)

    def _demoter(self, lower: Tier) -> Callable[[StoreKey, bytes], None]:
        """Write-back demotion: an evicted block moves one tier down (re-packed for it; a block
        that does not decode is not worth moving)."""

        def demote(key: StoreKey, data: bytes) -> None:
            try:
                block_hash = bytes.fromhex(key.rsplit(":", 1)[-1])
                if block_codec_id(data) == get_codec(self.codecs[lower.name]).id:  # as it is: no decoding
                    self._guard(lower, "put", lower.put, self.key(block_hash, lower.name), data)
                    return
                block = decode_block(data, self.namespace, self.block_shape, self.dtype, block_hash,
                                     _data_scheme(data))
            except (ValueError, CorruptBlock) as exc:
                log.warning("tier %s: not demoting unreadable block %s: %s", lower.name, key, exc)
                return
            self._move(lower, block_hash, block, data)

        return demote

    def _guard(self, tier: Tier, what: str, call: Callable, *args):
        """`call(*args)`, or None if it raised: tiers handle their own I/O errors, and anything
        they did not foresee must still not reach a request."""
        try:
            return call(*args)
        except Exception as exc:  # the boundary between tiers and the request path
            log.warning("tier %s: %s raised %s: %s; treating it as a miss", tier.name, what,
                        type(exc).__name__, exc)
            self._raised[tier.name] += 1
            return None


def _data_scheme(data: bytes | memoryview) -> str:
    """"exact" or the quantization of a current-format value (one that decoded)."""
    codec = BY_ID.get(block_codec_id(data) or 0)
    return "exact" if codec is None else scheme(codec)
