"""The on-wire / on-disk format of one KV block: a header, a per-layer table, the layers' bytes.

A block is all layers' K and V for `block_size` tokens, `[num_layers, 2, block_size,
num_kv_heads, head_dim]` contiguous (a layer-grouped model's: one group's layers), stored as ONE
value so a reader never sees half a block. The header names the namespace (model + dtype +
layout) so two models never read each other's KV, and the block's own identity (its chained
hash), so a value stored under another block's key (files swapped on disk, values swapped in a
pool) is refused, not served. It names the payload codec (codec.py), so a reader decodes
whatever the writer chose and knows whether the block is exact or quantized: a reader asks for
one scheme (exact, or int8 / int4) and refuses a block of another, so lossy KV is never taken for
exact KV. Each layer is its own chunk, with its stored length and a CRC32 of its stored bytes in
the table; a header CRC covers the header, the names and the table. So a reader can check (and
decode) layer l without touching layer l+1, and truncation, bit flips and corrupted compressed
streams are caught before anything is decoded. Values come from shared pools written by other
processes, so decoding never unpickles anything and never allocates more than one block.

Version 3 added the per-layer table; version 2 (one CRC over the whole decoded payload) and 1
blocks are unreadable (a miss, reason `version`); the version is also in the store's keys.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.errors import KVPoolError
from kvpool.store.codec import BY_ID, Codec, CodecError, get_codec, scheme
from kvpool.store.quant import Unquantizable

MAGIC = b"KVPB"
FORMAT_VERSION = 3
# magic, version, codec id, ndim, dtype length, identity length, namespace length, chunks,
# stored payload length, decoded payload length, header crc32
_FIXED = struct.Struct("<4sHBBBBHHQQI")
_CHUNK = struct.Struct("<II")  # stored length, crc32 of the stored bytes
_CRC_OFFSET = _FIXED.size - 4
_MAX_NDIM = 8


class CorruptBlock(KVPoolError):
    """A stored block is unreadable, or is another block's / model's; treat it as a miss.

    `reason` is a short fixed word (for metrics): short, magic, version, length, namespace,
    identity, shape, dtype, codec, lossy, checksum."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def block_namespace(
    model: str, dtype: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
    group_windows: Sequence[int | None] = (),
) -> str:
    """The namespace of a model's KV blocks: everything that changes their bytes. A layer-grouped
    model's (`group_windows`, kvpool/core/layer_groups.py) hold one group's layers per block."""
    groups = "|G" + ",".join("full" if w is None else str(w) for w in group_windows) if group_windows else ""
    return f"{model}|{dtype}|bs{block_size}|L{num_layers}xKV{num_kv_heads}xD{head_dim}{groups}"


def block_shape(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one stored block: `[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`."""
    return (num_layers, 2, block_size, num_kv_heads, head_dim)


def _chunks(shape: Sequence[int]) -> int:
    """Chunks of a block: one per layer (first axis); an array of under 2 dimensions is one."""
    return shape[0] if len(shape) >= 2 else 1


def max_encoded_size(namespace: str, block_id: bytes, shape: tuple[int, ...], dtype: np.dtype | str) -> int:
    """Largest value `encode_block` writes for such a block (a stored block is never larger
    than its raw bytes: a codec that would grow it is not used)."""
    dt = np.dtype(dtype)
    raw = dt.itemsize * int(np.prod(shape, dtype=np.int64))
    return (_FIXED.size + 8 * len(shape) + len(dt.str) + len(block_id) + len(namespace.encode())
            + _CHUNK.size * _chunks(shape) + raw)


def encode_block(namespace: str, block_id: bytes, array: np.ndarray, codec: str = "none") -> bytes:
    """Header + table + each layer of `array` (made C-contiguous) packed with `codec`. A
    lossless codec that would not shrink the payload gives way to "none"; a lossy one that
    cannot carry the values (inf, NaN) too, and a lossy one whose entropy stage does not shrink
    gives way to its bare quantizer. bfloat16 travels as its uint16 view."""
    arr = np.ascontiguousarray(array)
    if arr.ndim > _MAX_NDIM:
        raise ValueError(f"block has {arr.ndim} dimensions; at most {_MAX_NDIM} are supported")
    if len(block_id) > 255:
        raise ValueError(f"block identity is {len(block_id)} bytes; at most 255 are supported")
    layers = arr if arr.ndim >= 2 else arr.reshape(1, -1)
    chosen = get_codec(codec)
    raw = arr.nbytes
    try:
        stored = chosen.encode(layers) if chosen.id else None
    except Unquantizable:
        stored = None
    if stored is not None and chosen.quant is not None and chosen.entropy != "none" \
            and sum(map(len, stored)) >= len(layers) * chosen.plain_size(layers.shape[1:], 1):
        chosen = get_codec(chosen.quant.name)
        stored = chosen.encode(layers)
    if stored is None or (chosen.quant is None and sum(map(len, stored)) >= raw):
        chosen = get_codec("none")
        stored = chosen.encode(layers)
    dtype = arr.dtype.str.encode()
    ns = namespace.encode()
    table = b"".join(_CHUNK.pack(len(c), zlib.crc32(c)) for c in stored)
    variable = struct.pack(f"<{arr.ndim}Q", *arr.shape) + dtype + block_id + ns + table
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, chosen.id, arr.ndim, len(dtype), len(block_id), len(ns),
                       len(stored), sum(map(len, stored)), raw, 0)
    crc = zlib.crc32(variable, zlib.crc32(head[:_CRC_OFFSET]))
    return b"".join((head[:_CRC_OFFSET], struct.pack("<I", crc), variable, *stored))


def block_codec_id(data: bytes | memoryview) -> int | None:
    """The codec id a current-format value names, or None if it is not one (no checks beyond)."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        return None
    magic, version, codec_id = _FIXED.unpack_from(view)[:3]
    return codec_id if magic == MAGIC and version == FORMAT_VERSION else None


@dataclass(frozen=True, slots=True)
class CheckedBlock:
    """A value whose header and every layer's CRC passed, not yet decoded: a reader can decode
    one layer at a time (`block[l]`, layer l of `[layers, ...]`). `deferrable`: decoding cannot
    fail any more (no entropy stage; every size checked), so it may run where a failure could
    not be turned into a miss (under a forward pass)."""

    codec: Codec
    chunks: tuple[memoryview, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    payload: memoryview  # every layer's stored bytes, back to back

    @property
    def deferrable(self) -> bool:
        return self.codec.entropy == "none"

    def __len__(self) -> int:
        return self.shape[0]

    def layer(self, i: int) -> np.ndarray:
        layer = self.shape[1:]
        if self.codec.id == 0:
            return np.frombuffer(self.chunks[i], dtype=self.dtype).reshape(layer)
        return self._decode([self.chunks[i]], (1, *layer))[0]

    def __getitem__(self, key):
        if isinstance(key, int) and len(self.shape) >= 2:
            return self.layer(key)
        if isinstance(key, tuple) and key and isinstance(key[0], int) and len(self.shape) >= 2:
            return self.layer(key[0])[key[1:]]
        return self.array()[key]

    def array(self) -> np.ndarray:
        """The whole block (read-only; a view over the value when stored raw)."""
        if self.codec.id == 0:
            return np.frombuffer(self.payload, dtype=self.dtype).reshape(self.shape)
        layers = (self.shape[0], *self.shape[1:]) if len(self.shape) >= 2 else (1, int(np.prod(self.shape)))
        return self._decode(list(self.chunks), layers).reshape(self.shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.array()
        return out if dtype is None else out.astype(dtype)

    def _decode(self, chunks: list[memoryview], layers: tuple[int, ...]) -> np.ndarray:
        try:
            return self.codec.decode(chunks, layers, self.dtype)
        except (CodecError, ImportError, ValueError) as exc:
            raise CorruptBlock("codec", f"{self.codec.name} payload does not decode: {exc}") from exc


def decode_block(
    data: bytes | memoryview,
    expected_namespace: str,
    expected_shape: tuple[int, ...],
    expected_dtype: np.dtype | str,
    expected_id: bytes,
    accept: str = "exact",
) -> np.ndarray:
    """The block's array (read-only; a view over `data` when stored raw); CorruptBlock if
    anything is off, including a header that names another block than `expected_id`, or a
    block of another scheme than `accept` ("exact", or a lossy tier's "int8" / "int4"; an exact
    block is good for every reader)."""
    return check_block(data, expected_namespace, expected_shape, expected_dtype, expected_id, accept).array()


def check_block(
    data: bytes | memoryview,
    expected_namespace: str,
    expected_shape: tuple[int, ...],
    expected_dtype: np.dtype | str,
    expected_id: bytes,
    accept: str = "exact",
) -> CheckedBlock:
    """Every check of `decode_block` (header, names, each layer's length and CRC), no decoding."""
    view = memoryview(data)
    head = check_head(view, len(view), expected_namespace, expected_shape, expected_dtype, expected_id, accept)
    chunks = tuple(view[at : at + length] for at, length, _ in head.layers)
    for i, chunk in enumerate(chunks):
        head.check_layer(i, chunk)
    return CheckedBlock(head.codec, chunks, head.shape, head.dtype, view[head.size :])


@dataclass(frozen=True, slots=True)
class BlockHead:
    """A value's header and per-layer table, checked: where each layer's stored bytes are
    (`layers`: offset from the value's start, length, CRC32), so one layer can be read and
    checked (`check_layer`) without the others."""

    codec: Codec
    shape: tuple[int, ...]
    dtype: np.dtype
    size: int  # bytes of the header and the table: the first layer starts here
    layers: tuple[tuple[int, int, int], ...]

    def check_layer(self, i: int, chunk: bytes | memoryview) -> None:
        """CorruptBlock unless `chunk` is layer i's stored bytes (length and CRC)."""
        _, length, crc = self.layers[i]
        if len(chunk) != length:
            raise CorruptBlock("length", f"layer {i} is {len(chunk)} bytes, the table says {length}")
        if zlib.crc32(chunk) != crc:
            raise CorruptBlock("checksum", f"layer {i} checksum mismatch")


def head_size(namespace: str, block_id: bytes, shape: tuple[int, ...], dtype: np.dtype | str) -> int:
    """Bytes of the header and table of a value holding this block (what a layer-wise reader
    reads first; a value of another block or layout may have another size, and fails its checks)."""
    return (_FIXED.size + 8 * len(shape) + len(np.dtype(dtype).str) + len(block_id) + len(namespace.encode())
            + _CHUNK.size * _chunks(shape))


def declared_head_size(prefix: bytes | memoryview) -> int | None:
    """The header and table size a value's first bytes declare (None: too short to say)."""
    if len(prefix) < _FIXED.size:
        return None
    _, _, _, ndim, dtype_len, id_len, ns_len, nchunks = _FIXED.unpack_from(prefix)[:8]
    return _FIXED.size + 8 * ndim + dtype_len + id_len + ns_len + _CHUNK.size * nchunks


def check_head(
    prefix: bytes | memoryview,
    total_len: int,
    expected_namespace: str,
    expected_shape: tuple[int, ...],
    expected_dtype: np.dtype | str,
    expected_id: bytes,
    accept: str = "exact",
) -> BlockHead:
    """The header checks of `check_block` on a value's first bytes (`prefix`, at least its header
    and table) and its length (`total_len`); the layers' CRCs are left to `BlockHead.check_layer`."""
    view = memoryview(prefix)
    if min(len(view), total_len) < _FIXED.size:
        raise CorruptBlock("short", f"block is {total_len} bytes, shorter than the {_FIXED.size}-byte header")
    magic, version, codec_id, ndim, dtype_len, id_len, ns_len, nchunks, stored_len, raw_len, crc = \
        _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock("magic", f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlock("version", f"format version {version}, this reader knows {FORMAT_VERSION}")
    var_len = 8 * ndim + dtype_len + id_len + ns_len + _CHUNK.size * nchunks
    if total_len != _FIXED.size + var_len + stored_len:
        raise CorruptBlock("length", f"block is {total_len} bytes, header says {_FIXED.size + var_len + stored_len}")
    if len(view) < _FIXED.size + var_len:
        raise ValueError(f"{len(view)} bytes read of a {_FIXED.size + var_len}-byte header")
    variable = view[_FIXED.size : _FIXED.size + var_len]
    if zlib.crc32(variable, zlib.crc32(view[:_CRC_OFFSET])) != crc:
        raise CorruptBlock("checksum", "header checksum mismatch")
    shape = struct.unpack_from(f"<{ndim}Q", variable)
    at = 8 * ndim
    dtype_str = bytes(variable[at : at + dtype_len]).decode("ascii", "replace")
    at += dtype_len
    block_id = bytes(variable[at : at + id_len])
    at += id_len
    namespace = bytes(variable[at : at + ns_len]).decode("utf-8", "replace")
    at += ns_len
    if namespace != expected_namespace:
        raise CorruptBlock("namespace", f"namespace {namespace!r}, expected {expected_namespace!r}")
    if block_id != expected_id:
        raise CorruptBlock("identity", f"holds block {block_id.hex()}, expected {expected_id.hex()}")
    if tuple(shape) != tuple(expected_shape):
        raise CorruptBlock("shape", f"shape {tuple(shape)}, expected {tuple(expected_shape)}")
    dtype = np.dtype(expected_dtype)
    if dtype_str != dtype.str:
        raise CorruptBlock("dtype", f"dtype {dtype_str!r}, expected {dtype.str!r}")
    if raw_len != dtype.itemsize * int(np.prod(shape, dtype=np.int64)) or nchunks != _chunks(shape):
        raise CorruptBlock("length", f"payload is {raw_len} bytes in {nchunks} chunks, shape {tuple(shape)} "
                           "needs other")
    codec = BY_ID.get(codec_id)
    if codec is None:
        raise CorruptBlock("codec", f"unknown codec id {codec_id}")
    if codec.quant is not None and scheme(codec) != accept:
        raise CorruptBlock("lossy", f"a {codec.name} block (quantized KV); this reader takes {accept} KV")
    layer_shape = tuple(shape[1:]) if ndim >= 2 else (int(np.prod(shape, dtype=np.int64)),)
    plain = codec.plain_size(layer_shape, dtype.itemsize) if codec.entropy == "none" else None
    layers = []
    pos = _FIXED.size + var_len
    for i in range(nchunks):
        length, chunk_crc = _CHUNK.unpack_from(variable, at + i * _CHUNK.size)
        if pos + length > total_len:
            raise CorruptBlock("length", f"layer {i} overruns the payload")
        if plain is not None and length != plain:
            raise CorruptBlock("length", f"layer {i} is {length} bytes, {codec.name} needs {plain}")
        layers.append((pos, length, chunk_crc))
        pos += length
    if pos != total_len:
        raise CorruptBlock("length", f"layers hold {pos - _FIXED.size - var_len} bytes, header names {stored_len}")
    return BlockHead(codec, tuple(shape), dtype, _FIXED.size + var_len, tuple(layers))
