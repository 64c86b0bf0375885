"""Deterministic synthetic token ids and chunk-addressed block keys for simulated prompts.

A simulated prompt is a tuple of content-addressed chunks `(chunk_id, length)`: a chunk's
tokens depend only on its id (and the seed), the first `length` of a fixed stream, so equal
ids give equal tokens and therefore equal chained block hashes in the real KV manager.
Mooncake trace hash ids map to chunks directly; synthetic workloads allocate their own ids.

`BlockHasher` names every full block of such a prompt without hashing its tokens (BLAKE2b over
a whole trace's 5.9M distinct blocks was a tenth of a run): a block's key is an int interned for
its parent's key, the tokens carried over from earlier chunks, its chunk and its place in the
chunk, which fix its tokens and every token before them, as its chained hash does. So two blocks
share a key exactly when their chained hashes over the materialized tokens are equal, but for
whole blocks of random tokens repeating by chance (tested). Keys come from one counter: a
prompt's new blocks get consecutive ints, whose slots in the block pool's and the conductor's
hash tables are neighbours, and two hashers never hand out the same key (mixing their keys can
miss a share, never invent one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from itertools import count, islice

import numpy as np

from kvpool.core.hashing import BlockHash, hash_blocks
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


_KEYS = count(1)  # every hasher's block keys


class BlockHasher:
    """Keys of every full block of chunked prompts at `block_size` (`kvpool.core.hashing`'s
    `BlockHash`, as ints), shared by all the prompts one hasher names.

    Memory grows with the distinct blocks named; drop the hasher to release it.
    """

    def __init__(self, block_size: int, synth: TokenSynth) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size={block_size} must be >= 1")
        self.block_size, self.synth = block_size, synth
        # (parent key, carried-over token bytes, chunk id) -> the keys of that chunk's blocks so far
        self._runs: dict[tuple[int | None, bytes, int], list[int]] = {}

    def hashes(self, chunks: Chunks) -> list[BlockHash]:
        """Keys of every full block of the prompt `chunks` describes."""
        B, runs = self.block_size, self._runs
        parent: int | None = None  # the first block's
        pending = b""
        out: list[BlockHash] = []
        last = len(chunks) - 1
        for k, (cid, length) in enumerate(chunks):
            run = runs.setdefault((parent, pending, cid), [])
            tokens = len(pending) // 8 + length
            full = tokens // B
            if len(run) < full:
                run += islice(_KEYS, full - len(run))
            if full:
                out += run[:full]
                parent = run[full - 1]
            if tokens % B and k < last:  # the partial block's tokens carry over into the next chunk's first block
                pending = (pending + self.synth.chunk_array(cid, length).tobytes())[full * B * 8 :]
            else:
                pending = b""
        return out


def name_blocks(tokens: Sequence[int], block_size: int, cache_salt: str | None = None,
                parent: BlockHash | None = None, start_block: int = 0, limit: int | None = None) -> list[BlockHash]:
    """`hash_blocks` for a simulated KV manager (`KVCacheManager.name_blocks`): blocks chained
    from a `BlockHasher` key get new keys instead of digests. Exact because every such block
    holds placeholder tokens no other block of its instance holds (a marker per prompt, one per
    drawn token), so their digests would all differ too, and no chain the manager hashes from
    the root (a recomputed prompt) reaches them; blocks chained from the root are hashed."""
    if not isinstance(parent, int):
        return hash_blocks(tokens, block_size, cache_salt=cache_salt, parent=parent, start_block=start_block,
                           limit=limit)
    end = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    return list(islice(_KEYS, max(end - start_block, 0)))
