"""A stored block read layer by layer: its header and per-layer table are read and checked first
(before the step that uses the block), each layer only when the loader needs it (under the forward
pass, layer l+1 while layer l computes), checked against its CRC in the table as it arrives.

Format 3 needs no change for this: the header CRC covers the table, so each layer's offset, length
and CRC are trusted once the header passed, and a layer is checked without reading the next. A
layer read later can still fail: its bytes flipped (CorruptBlock, the entry is dropped) or the value
gone meanwhile, evicted or the tier down (`LayerUnavailable`). Either way the reader must not use
the block from there; the engine rewinds the sequence to it (kvpool/core/rewind.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvpool.core.hashing import BlockHash
from kvpool.errors import KVPoolError
from kvpool.store.format import BlockHead, CheckedBlock, check_head, declared_head_size, head_size

# (offset, length) -> (bytes, value size), or None: the tier's `get_range` behind the store's guard
RangeRead = Callable[[int, int], "tuple[bytes, int] | None"]


class LayerUnavailable(KVPoolError):
    """A layer of a block whose header was read could not be read (the value is gone, or the
    tier failed): a miss, not a bad entry."""


@dataclass(slots=True)
class LayeredBlock:
    """One block whose header passed, from tier `tier` (index `tier_index` in the store); `block[l]`
    reads, checks and decodes layer l. `keep`: hold the layers' bytes, to promote the whole value
    once every layer was read (`value`)."""

    tier: str
    tier_index: int
    block_hash: BlockHash
    head: BlockHead
    prefix: bytes
    read: RangeRead
    keep: bool = False
    elapsed_s: float = 0.0  # time spent reading and checking, header included
    _chunks: dict[int, bytes] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.head.shape

    @property
    def nbytes(self) -> int:
        """The stored value's size."""
        return self.head.size + sum(length for _, length, _ in self.head.layers)

    def __len__(self) -> int:
        return self.head.shape[0]

    def layer(self, i: int) -> np.ndarray:
        """Layer i, read and checked now: CorruptBlock if its bytes fail the table's length or CRC
        (or do not decode), LayerUnavailable if they cannot be read."""
        start = time.monotonic()
        offset, length, _ = self.head.layers[i]
        got = self.read(offset, length)
        if got is None:
            raise LayerUnavailable(f"layer {i} of block {self.block_hash.hex()} is gone from the {self.tier} tier")
        data, size = got
        if size != self.nbytes:
            raise LayerUnavailable(f"block {self.block_hash.hex()} in the {self.tier} tier changed since its header "
                                   f"was read ({size} bytes, was {self.nbytes})")
        self.head.check_layer(i, data)
        head = self.head
        out = CheckedBlock(head.codec, (memoryview(data),), (1, *head.shape[1:]), head.dtype, memoryview(data)).layer(0)
        if self.keep:
            self._chunks[i] = data
        self.elapsed_s += time.monotonic() - start
        return out

    def __getitem__(self, key):
        if isinstance(key, int):
            return self.layer(key)
        if isinstance(key, tuple) and key and isinstance(key[0], int):
            return self.layer(key[0])[key[1:]]
        raise TypeError(f"a layered block is read one layer at a time (block[l] or block[l, ...]), not [{key!r}]")

    def value(self) -> bytes | None:
        """The whole stored value, once every layer was read with `keep` (None before)."""
        if len(self._chunks) != len(self.head.layers):
            return None
        return b"".join((self.prefix, *(self._chunks[i] for i in range(len(self.head.layers)))))


def open_layered(read: RangeRead, tier: str, index: int, block_hash: BlockHash, namespace: str,
                 shape: tuple[int, ...], dtype: np.dtype, accept: str) -> LayeredBlock | None:
    """The block's value in tier `tier` (index `index`), `read` through its range reads, with its
    header and table read and checked: None on a miss, CorruptBlock for a bad entry."""
    start = time.monotonic()
    got = read(0, head_size(namespace, block_hash, shape, dtype))
    if got is None:
        return None
    declared = declared_head_size(got[0])
    if declared is not None and len(got[0]) < declared <= got[1]:  # another layout: read it to say why
        got = read(0, declared)
        if got is None:
            return None
    prefix, total = got
    head = check_head(prefix, total, namespace, shape, dtype, block_hash, accept)
    return LayeredBlock(tier, index, block_hash, head, bytes(prefix[: head.size]), read, keep=index > 0,
                        elapsed_s=time.monotonic() - start)
