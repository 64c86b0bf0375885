"""The tiered KV store: lookup / load / save of KV blocks by chained hash across tiers.

Tiers are ordered fastest first (host, disk, remote). A request can reuse the longest run
of blocks present from its first block, each block from whichever tier has it. Loads
promote blocks into the first tier. Write-through saves to every tier; write-back saves
to the first tier only and each tier demotes its evicted blocks to the next one. A block
that fails to decode is treated as a miss and deleted from the tier that served it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from kvpool.core.hashing import BlockHash
from kvpool.errors import ConfigError
from kvpool.store.format import CorruptBlock, decode_block, encode_block
from kvpool.store.tier import StoreKey, Tier, TierStats

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write-through", "write-back")


def namespace_id(namespace: str) -> str:
    """Short fixed-length tag of a namespace, used in keys (the full name is in each header)."""
    return hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()


class TieredKVStore:
    """Blocks of one namespace (model, dtype, layout) across `tiers`, fastest first."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        namespace: str,
        block_shape: tuple[int, ...],
        dtype: np.dtype | str,
        write_policy: str = "write-through",
        workers: int = 2,
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
        self.tiers = list(tiers)
        self.namespace = namespace
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        self.write_policy = write_policy
        self.corrupt_blocks: dict[str, int] = dict.fromkeys(names, 0)
        self._prefix = f"kv:{namespace_id(namespace)}:"
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore")
        self._pending: set[Future[bool]] = set()
        if write_policy == "write-back":
            for upper, lower in zip(self.tiers, self.tiers[1:], strict=False):
                if hasattr(upper, "on_evict"):
                    upper.on_evict = _demoter(lower)

    def key(self, block_hash: BlockHash) -> StoreKey:
        """The namespaced key of a block in every tier."""
        return self._prefix + block_hash.hex()

    def lookup(self, hashes: Sequence[BlockHash]) -> tuple[int, list[str]]:
        """Longest run of present blocks from the first, and the fastest tier holding each."""
        keys = [self.key(h) for h in hashes]
        where: list[str] = []
        pos = 0
        while pos < len(keys):
            for tier in self.tiers:
                run = tier.lookup(keys[pos:])
                if run:
                    where.extend([tier.name] * run)
                    pos += run
                    break
            else:
                break
        return pos, where

    def load(self, hashes: Sequence[BlockHash]) -> list[np.ndarray]:
        """Blocks of the longest loadable prefix of `hashes` (stops at the first miss).

        Each array has `block_shape` and `dtype` and is read-only; copy it into the KV cache.
        """
        out: list[np.ndarray] = []
        for h in hashes:
            block = self._load_one(self.key(h))
            if block is None:
                break
            out.append(block)
        return out

    def _load_one(self, key: StoreKey) -> np.ndarray | None:
        for i, tier in enumerate(self.tiers):
            data = tier.get(key)
            if data is None:
                continue
            try:
                block = decode_block(data, self.namespace, self.block_shape, self.dtype)
            except CorruptBlock as exc:
                log.warning("tier %s: dropping unreadable block %s: %s", tier.name, key, exc)
                self.corrupt_blocks[tier.name] += 1
                tier.delete(key)
                continue
            if i > 0:
                self.tiers[0].put(key, data)
            return block
        return None

    def save(self, block_hash: BlockHash, block: np.ndarray) -> bool:
        """Store one block (`block_shape`, `dtype`); True if at least one tier kept it."""
        if block.shape != self.block_shape or block.dtype != self.dtype:
            raise ConfigError(
                f"block is {block.shape} {block.dtype}, this store holds {self.block_shape} {self.dtype}"
            )
        key = self.key(block_hash)
        data = encode_block(self.namespace, block)
        if self.write_policy == "write-back":
            return self.tiers[0].put(key, data)
        stored = [tier.put(key, data) for tier in self.tiers]
        return any(stored)

    def save_async(self, block_hash: BlockHash, block: np.ndarray) -> Future[bool]:
        """`save` on a worker thread; the block is copied now, so the caller may reuse it."""
        future = self._pool.submit(self.save, block_hash, np.array(block, copy=True))
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def load_async(self, hashes: Sequence[BlockHash]) -> Future[list[np.ndarray]]:
        """`load` on a worker thread, to overlap the read with compute."""
        return self._pool.submit(self.load, list(hashes))

    def flush(self) -> None:
        """Wait until every save queued so far has finished."""
        pending, self._pending = self._pending, set()
        wait(pending)

    def stats(self) -> dict[str, TierStats]:
        return {tier.name: tier.stats() for tier in self.tiers}

    def close(self) -> None:
        """Finish pending async work, then release every tier."""
        self._pool.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()


def _demoter(lower: Tier) -> Callable[[StoreKey, bytes], None]:
    """Write-back demotion: an evicted block moves one tier down."""

    def demote(key: StoreKey, data: bytes) -> None:
        lower.put(key, data)

    return demote
