"""The on-wire / on-disk format of one KV block: a fixed header plus the (encoded) tensor bytes.

A block is all layers' K and V for `block_size` tokens, `[num_layers, 2, block_size,
num_kv_heads, head_dim]` contiguous (a layer-grouped model's: one group's layers), stored as ONE value so a reader never sees half a block.
The header names the namespace (model + dtype + layout) so two models never read each
other's KV, and the block's own identity (its chained hash), so a value stored under another
block's key (files swapped on disk, values swapped in a pool) is refused, not served. It names
the payload codec (codec.py), so a reader decodes whatever the writer chose, and carries a
CRC32 over the header and the *decoded* bytes, which catches truncation, bit flips and a
corrupted compressed stream alike. Values come from shared pools written by other processes,
so decoding never unpickles anything and never allocates more than one block's bytes.

Version 2 added the identity and the codec; a version-1 block is unreadable (a miss).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np

from kvpool.errors import KVPoolError
from kvpool.store.codec import BY_ID, CodecError, get_codec

MAGIC = b"KVPB"
FORMAT_VERSION = 2
# magic, version, codec id, ndim, dtype length, identity length, namespace length,
# stored payload length, decoded payload length, crc32
_FIXED = struct.Struct("<4sHBBBBHQQI")
_CRC_OFFSET = _FIXED.size - 4
_MAX_NDIM = 8


class CorruptBlock(KVPoolError):
    """A stored block is unreadable, or is another block's / model's; treat it as a miss.

    `reason` is a short fixed word (for metrics): short, magic, version, length, namespace,
    identity, shape, dtype, codec, checksum."""

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


def max_encoded_size(namespace: str, block_id: bytes, shape: tuple[int, ...], dtype: np.dtype | str) -> int:
    """Largest value `encode_block` writes for such a block (a codec never grows a payload)."""
    dt = np.dtype(dtype)
    raw = dt.itemsize * int(np.prod(shape, dtype=np.int64))
    return _FIXED.size + 8 * len(shape) + len(dt.str) + len(block_id) + len(namespace.encode()) + raw


def _crc(header_without_crc: bytes | memoryview, variable: bytes | memoryview, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(variable, zlib.crc32(header_without_crc)))


def encode_block(namespace: str, block_id: bytes, array: np.ndarray, codec: str = "none") -> bytes:
    """Header + bytes of `array` (made C-contiguous) packed with `codec`; a payload the codec
    would not shrink is stored raw (codec "none"). bfloat16 travels as its uint16 view."""
    arr = np.ascontiguousarray(array)
    if arr.ndim > _MAX_NDIM:
        raise ValueError(f"block has {arr.ndim} dimensions; at most {_MAX_NDIM} are supported")
    if len(block_id) > 255:
        raise ValueError(f"block identity is {len(block_id)} bytes; at most 255 are supported")
    dtype = arr.dtype.str.encode()
    ns = namespace.encode()
    raw = memoryview(arr).cast("B")
    chosen = get_codec(codec)
    stored: bytes | memoryview = chosen.encode(raw, arr.itemsize) if chosen.id else raw
    if len(stored) >= len(raw):
        chosen, stored = get_codec("none"), raw
    variable = struct.pack(f"<{arr.ndim}Q", *arr.shape) + dtype + block_id + ns
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, chosen.id, arr.ndim, len(dtype), len(block_id), len(ns),
                       len(stored), arr.nbytes, 0)
    crc = _crc(head[:_CRC_OFFSET], variable, raw)
    return b"".join((head[:_CRC_OFFSET], struct.pack("<I", crc), variable, stored))


def block_codec_id(data: bytes | memoryview) -> int | None:
    """The codec id a current-format value names, or None if it is not one (no checks beyond)."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        return None
    magic, version, codec_id = _FIXED.unpack_from(view)[:3]
    return codec_id if magic == MAGIC and version == FORMAT_VERSION else None


def decode_block(
    data: bytes | memoryview,
    expected_namespace: str,
    expected_shape: tuple[int, ...],
    expected_dtype: np.dtype | str,
    expected_id: bytes,
) -> np.ndarray:
    """The block's array (read-only; a view over `data` when stored raw); CorruptBlock if
    anything is off, including a header that names another block than `expected_id`."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise CorruptBlock("short", f"block is {len(view)} bytes, shorter than the {_FIXED.size}-byte header")
    magic, version, codec_id, ndim, dtype_len, id_len, ns_len, stored_len, raw_len, crc = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock("magic", f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlock("version", f"format version {version}, this reader knows {FORMAT_VERSION}")
    var_len = 8 * ndim + dtype_len + id_len + ns_len
    if len(view) != _FIXED.size + var_len + stored_len:
        raise CorruptBlock("length", f"block is {len(view)} bytes, header says {_FIXED.size + var_len + stored_len}")
    variable = view[_FIXED.size : _FIXED.size + var_len]
    shape = struct.unpack_from(f"<{ndim}Q", variable)
    at = 8 * ndim
    dtype_str = bytes(variable[at : at + dtype_len]).decode("ascii", "replace")
    block_id = bytes(variable[at + dtype_len : at + dtype_len + id_len])
    namespace = bytes(variable[at + dtype_len + id_len :]).decode("utf-8", "replace")
    if namespace != expected_namespace:
        raise CorruptBlock("namespace", f"namespace {namespace!r}, expected {expected_namespace!r}")
    if block_id != expected_id:
        raise CorruptBlock("identity", f"holds block {block_id.hex()}, expected {expected_id.hex()}")
    if tuple(shape) != tuple(expected_shape):
        raise CorruptBlock("shape", f"shape {tuple(shape)}, expected {tuple(expected_shape)}")
    dtype = np.dtype(expected_dtype)
    if dtype_str != dtype.str:
        raise CorruptBlock("dtype", f"dtype {dtype_str!r}, expected {dtype.str!r}")
    if raw_len != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
        raise CorruptBlock("length", f"payload is {raw_len} bytes, shape {tuple(shape)} needs more or less")
    codec = BY_ID.get(codec_id)
    if codec is None:
        raise CorruptBlock("codec", f"unknown codec id {codec_id}")
    if codec.id == 0 and stored_len != raw_len:
        raise CorruptBlock("length", f"raw payload is {stored_len} bytes, header names {raw_len}")
    stored = view[_FIXED.size + var_len :]
    try:
        payload = codec.decode(stored, raw_len, dtype.itemsize) if codec.id else stored
    except (CodecError, ImportError) as exc:
        raise CorruptBlock("codec", f"{codec.name} payload does not decode: {exc}") from exc
    if _crc(view[:_CRC_OFFSET], variable, payload) != crc:
        raise CorruptBlock("checksum", "checksum mismatch")
    return np.frombuffer(payload, dtype=dtype).reshape(shape)
