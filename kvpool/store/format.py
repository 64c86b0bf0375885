"""The on-wire / on-disk format of one KV block: a fixed header plus the raw tensor bytes.

A block is all layers' K and V for `block_size` tokens, `[num_layers, 2, block_size,
num_kv_heads, head_dim]` contiguous, stored as ONE value so a reader never sees half a block.
The header names the namespace (model + dtype + layout) so two models never read each
other's KV, and a CRC32 over header and payload catches truncation and bit flips. Values
come from shared pools written by other processes, so decoding never unpickles anything.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from kvpool.errors import KVPoolError

MAGIC = b"KVPB"
FORMAT_VERSION = 1
# magic, version, ndim, dtype length, namespace length, payload length, crc32
_FIXED = struct.Struct("<4sHBBHQI")
_CRC_OFFSET = _FIXED.size - 4
_MAX_NDIM = 8


class CorruptBlock(KVPoolError):
    """A stored block is unreadable or belongs to another model/layout; treat it as a miss."""


def block_namespace(
    model: str, dtype: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int
) -> str:
    """The namespace of a model's KV blocks: everything that changes their bytes."""
    return f"{model}|{dtype}|bs{block_size}|L{num_layers}xKV{num_kv_heads}xD{head_dim}"


def block_shape(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one stored block: `[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`."""
    return (num_layers, 2, block_size, num_kv_heads, head_dim)


def _crc(header_without_crc: bytes, variable: bytes, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(variable, zlib.crc32(header_without_crc)))


def encode_block(namespace: str, array: np.ndarray) -> bytes:
    """Header + raw bytes of `array` (made C-contiguous). bfloat16 travels as its uint16 view."""
    arr = np.ascontiguousarray(array)
    if arr.ndim > _MAX_NDIM:
        raise ValueError(f"block has {arr.ndim} dimensions; at most {_MAX_NDIM} are supported")
    dtype = arr.dtype.str.encode()
    ns = namespace.encode()
    payload = memoryview(arr).cast("B")
    variable = struct.pack(f"<{arr.ndim}Q", *arr.shape) + dtype + ns
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, arr.ndim, len(dtype), len(ns), arr.nbytes, 0)
    crc = _crc(head[:_CRC_OFFSET], variable, payload)
    return b"".join((head[:_CRC_OFFSET], struct.pack("<I", crc), variable, payload))


def decode_block(
    data: bytes | memoryview,
    expected_namespace: str,
    expected_shape: tuple[int, ...],
    expected_dtype: np.dtype | str,
) -> np.ndarray:
    """The block's array (a read-only view over `data`); CorruptBlock if anything is off."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise CorruptBlock(f"block is {len(view)} bytes, shorter than the {_FIXED.size}-byte header")
    magic, version, ndim, dtype_len, ns_len, payload_len, crc = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"format version {version}, this reader knows {FORMAT_VERSION}")
    var_len = 8 * ndim + dtype_len + ns_len
    if len(view) != _FIXED.size + var_len + payload_len:
        raise CorruptBlock(
            f"block is {len(view)} bytes, header says {_FIXED.size + var_len + payload_len}"
        )
    variable = view[_FIXED.size : _FIXED.size + var_len]
    payload = view[_FIXED.size + var_len :]
    if _crc(view[:_CRC_OFFSET], variable, payload) != crc:
        raise CorruptBlock("checksum mismatch")
    shape = struct.unpack_from(f"<{ndim}Q", variable)
    dtype_str = bytes(variable[8 * ndim : 8 * ndim + dtype_len]).decode("ascii", "replace")
    namespace = bytes(variable[8 * ndim + dtype_len :]).decode("utf-8", "replace")
    if namespace != expected_namespace:
        raise CorruptBlock(f"namespace {namespace!r}, expected {expected_namespace!r}")
    if tuple(shape) != tuple(expected_shape):
        raise CorruptBlock(f"shape {tuple(shape)}, expected {tuple(expected_shape)}")
    dtype = np.dtype(expected_dtype)
    if dtype_str != dtype.str:
        raise CorruptBlock(f"dtype {dtype_str!r}, expected {dtype.str!r}")
    if payload_len != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
        raise CorruptBlock(f"payload is {payload_len} bytes, shape {tuple(shape)} needs more or less")
    return np.frombuffer(payload, dtype=dtype).reshape(shape)
