"""Deterministic synthetic token ids and fast chained block hashes for simulated prompts.

A simulated prompt is a tuple of content-addressed chunks `(chunk_id, length)`: a chunk's
tokens depend only on its id (and the seed), the first `length` of a fixed stream, so equal
ids give equal tokens and therefore equal chained block hashes in the real KV manager.
Mooncake trace hash ids map to chunks directly; synthetic workloads allocate their own ids.

Hashing a whole trace from Python lists is too slow (~145M tokens), so `BlockHasher` feeds the
tokens' byte encoding straight to the core's chained-hash loop (`chain_hashes`) and memoizes
per (parent hash, carried-over tokens, chunk): a prefix shared by many requests is hashed once.
Its output equals `kvpool.core.hashing.hash_blocks` on the materialized tokens (tested).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from kvpool.core.hashing import BlockHash, chain_hashes, root_hash
from kvpool.errors import ConfigError

Chunks = tuple[tuple[int, int], ...]


class TokenSynth:
    """Token ids of chunks: SHAKE-128(seed, chunk_id) read as uint16 (uint32 for vocabularies
    over 65,536) words, mod vocab_size.

    An extendable-output hash makes a shorter chunk the prefix of a longer one with the same id.
    """

    def __init__(self, seed: int = 0, vocab_size: int = 32000) -> None:
        if not 2 <= vocab_size < 2**32:
            raise ConfigError(f"vocab_size={vocab_size} must be in [2, 2**32)")
        self.seed, self.vocab_size = seed, vocab_size
        self._prefix = b"kvpool-synth-v1" + seed.to_bytes(8, "little", signed=True)
        self._word = np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")
        self._vocab = np.uint32(vocab_size)

    def chunk_array(self, chunk_id: int, length: int) -> np.ndarray:
        """int64 token ids of one chunk (little-endian, as the block hash encodes them)."""
        if chunk_id < 0:
            raise ConfigError(f"chunk_id={chunk_id} must be >= 0")
        raw = hashlib.shake_128(self._prefix + chunk_id.to_bytes(8, "little")).digest(self._word.itemsize * length)
        return (np.frombuffer(raw, dtype=self._word) % self._vocab).astype("<i8")

    def tokens(self, chunks: Iterable[tuple[int, int]]) -> list[int]:
        """Materialized token ids of a chunk sequence (fine for short prompts)."""
        parts = [self.chunk_array(cid, n) for cid, n in chunks]
        return np.concatenate(parts).tolist() if parts else []


class BlockHasher:
    """Chained block hashes of chunked prompts at `block_size`, memoized across requests.

    Memory grows with the distinct (prefix, chunk) pairs seen; drop the hasher to release it.
    """

    def __init__(self, block_size: int, synth: TokenSynth, namespace: str = "") -> None:
        if block_size < 1:
            raise ConfigError(f"block_size={block_size} must be >= 1")
        self.block_size, self.synth = block_size, synth
        self._root = root_hash(namespace)
        self._bytes_per_block = 8 * block_size
        self._memo: dict[tuple[BlockHash, bytes, int, int], tuple[list[BlockHash], BlockHash, bytes]] = {}

    def hashes(self, chunks: Chunks) -> list[BlockHash]:
        """Hashes of every full block of the prompt `chunks` describes."""
        parent, pending = self._root, b""
        out: list[BlockHash] = []
        for cid, length in chunks:
            key = (parent, pending, cid, length)
            hit = self._memo.get(key)
            if hit is None:
                hit = self._hash_chunk(parent, pending + self.synth.chunk_array(cid, length).tobytes())
                self._memo[key] = hit
            out.extend(hit[0])
            parent, pending = hit[1], hit[2]
        return out

    def _hash_chunk(self, parent: BlockHash, data: bytes) -> tuple[list[BlockHash], BlockHash, bytes]:
        hashes = chain_hashes(parent, data, self.block_size)
        return hashes, hashes[-1] if hashes else parent, data[len(hashes) * self._bytes_per_block :]

    @property
    def memo_entries(self) -> int:
        return len(self._memo)
