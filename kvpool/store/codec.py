"""Payload codecs of a stored KV block: how each layer's tensor bytes are packed for a tier.

Lossless (ids below LOSSY_BASE; decode gives the exact bytes). Measured on real KV blocks of the
bundled model (`kvpool bench kvstore --codecs ...`): KV floats have little byte-level redundancy
except in the sign/exponent bytes, so lz4 finds nothing (ratio <= 1.0) and zstd at level 1
gains ~1.07x (float32) to ~1.26x (bfloat16); grouping byte planes first (`zstd-shuffle`: byte
k of every element together, each plane its own zstd frame: one frame over a 12 KB layer's
mixed planes gave 1.26x, separate frames 1.41x on bfloat16) adds more at about twice the decode cost.

Lossy (ids from LOSSY_BASE up): `int8`, `int4` quantize float KV (quant.py: per-group codes +
float16 scales stored in the block), `+zstd` entropy-codes the result; decode dequantizes into
the block's dtype. A codec id is one byte of the block header, so a reader decodes whatever
the writer chose, and knows (`Codec.quant`) whether it gets exact KV or an approximation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from kvpool.errors import ConfigError, KVPoolError
from kvpool.store.quant import QUANTIZERS, Quantizer, from_float32, to_float32

LOSSY_BASE = 64
_ZSTD_LEVEL = 1  # level 3 gained nothing on KV (same ratio to 3 digits) at ~1.5x the encode cost


class CodecError(KVPoolError):
    """A payload does not decode with the codec its header names."""


def _zstd() -> ModuleType:
    import zstandard  # a declared dependency; imported on use so the store loads without it

    return zstandard


def _shuffle(raw: memoryview | bytes, itemsize: int) -> bytes | memoryview:
    """Byte planes: byte k of every element, for k = 0..itemsize-1 (exponents end up together)."""
    if itemsize == 1:
        return raw
    return np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T.tobytes()


def _unshuffle(planes: bytes | memoryview, itemsize: int) -> bytes | memoryview:
    if itemsize == 1:
        return planes
    return np.frombuffer(planes, np.uint8).reshape(itemsize, -1).T.tobytes()


def _zstd_encode(raw: bytes | memoryview) -> bytes:
    return _zstd().ZstdCompressor(level=_ZSTD_LEVEL, write_content_size=True).compress(raw)


def _zstd_decode(stored: memoryview, raw_len: int) -> bytes:
    zstd = _zstd()
    try:
        # The frame names its decoded size; check it before decompressing, so a hostile value
        # cannot make the reader allocate more than one layer.
        if zstd.frame_content_size(stored) != raw_len:
            raise CodecError(f"zstd frame does not hold the {raw_len} bytes the header names")
        out = zstd.ZstdDecompressor().decompress(stored, max_output_size=raw_len, allow_extra_data=False)
    except zstd.ZstdError as exc:
        raise CodecError(f"zstd: {exc}") from exc
    if len(out) != raw_len:
        raise CodecError(f"zstd gave {len(out)} bytes, the header names {raw_len}")
    return out


def _planes_encode(plain: bytes | memoryview, itemsize: int) -> bytes:
    """Each byte plane its own length-prefixed zstd frame (their statistics differ)."""
    planes = np.frombuffer(_shuffle(plain, itemsize), np.uint8).reshape(itemsize, -1)
    frames = [_zstd_encode(p.tobytes()) for p in planes]
    return b"".join(len(f).to_bytes(4, "little") + f for f in frames)


def _planes_decode(stored: memoryview, plain_len: int, itemsize: int) -> bytes | memoryview:
    if plain_len % itemsize:
        raise CodecError(f"{plain_len} bytes are not whole {itemsize}-byte elements")
    planes, at = [], 0
    for _ in range(itemsize):
        n = int.from_bytes(stored[at : at + 4], "little")
        if at + 4 + n > len(stored):
            raise CodecError(f"plane frame of {n} bytes overruns the {len(stored)}-byte layer")
        planes.append(_zstd_decode(stored[at + 4 : at + 4 + n], plain_len // itemsize))
        at += 4 + n
    if at != len(stored):
        raise CodecError(f"{len(stored) - at} bytes after the last plane frame")
    return _unshuffle(b"".join(planes), itemsize)


def _pack(plain: bytes | memoryview, entropy: str, itemsize: int) -> bytes | memoryview:
    if entropy == "zstd":
        return _zstd_encode(plain)
    if entropy == "zstd-shuffle":
        return _planes_encode(plain, itemsize)
    return plain


def _unpack(stored: memoryview, entropy: str, plain_len: int, itemsize: int) -> bytes | memoryview:
    if entropy == "zstd":
        return _zstd_decode(stored, plain_len)
    if entropy == "zstd-shuffle":
        return _planes_decode(stored, plain_len, itemsize)
    if len(stored) != plain_len:
        raise CodecError(f"payload is {len(stored)} bytes, the layer needs {plain_len}")
    return stored


@dataclass(frozen=True, slots=True)
class Codec:
    """`entropy` (none | zstd | zstd-shuffle) after `quant` (None: the exact bytes)."""

    name: str
    id: int
    entropy: str
    quant: Quantizer | None = None

    @property
    def lossless(self) -> bool:
        return self.quant is None

    def plain_size(self, layer: tuple[int, ...], itemsize: int) -> int:
        """Bytes of one layer before the entropy stage."""
        if self.quant is None:
            return itemsize * int(np.prod(layer, dtype=np.int64))
        return self.quant.plain_size(layer)

    def encode(self, layers: np.ndarray) -> list[bytes | memoryview]:
        """One stored chunk per entry of `layers`' first axis (C-contiguous input)."""
        if self.quant is None:
            return [_pack(memoryview(layer).cast("B"), self.entropy, layers.itemsize) for layer in layers]
        return [_pack(p, self.entropy, 1) for p in self.quant.pack(to_float32(layers))]

    def decode(self, chunks: Sequence[memoryview], shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """`shape` (first axis: the chunks) of `dtype` from the stored chunks; CodecError if one
        does not decode. Lossy codecs dequantize into `dtype`."""
        size = self.plain_size(shape[1:], dtype.itemsize)
        isz = 1 if self.quant is not None else dtype.itemsize
        plains = [_unpack(c, self.entropy, size, isz) for c in chunks]
        plain = plains[0] if len(plains) == 1 else b"".join(plains)
        if self.quant is None:
            return np.frombuffer(plain, dtype=dtype).reshape(shape)
        return from_float32(self.quant.unpack(plain, shape), dtype)


CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("none", 0, "none"),
    Codec("zstd", 1, "zstd"),
    Codec("zstd-shuffle", 2, "zstd-shuffle"),
    Codec("int8", LOSSY_BASE, "none", QUANTIZERS["int8"]),
    Codec("int8+zstd", LOSSY_BASE + 1, "zstd", QUANTIZERS["int8"]),
    Codec("int4", LOSSY_BASE + 2, "none", QUANTIZERS["int4"]),
    Codec("int4+zstd", LOSSY_BASE + 3, "zstd", QUANTIZERS["int4"]),
)}
BY_ID: dict[int, Codec] = {c.id: c for c in CODECS.values()}


def scheme(codec: Codec) -> str:
    """What a block of this codec holds: "exact", or the quantizer's name (int8, int4)."""
    return "exact" if codec.quant is None else codec.quant.name


def get_codec(name: str, what: str = "codec") -> Codec:
    """The codec called `name`, usable here; ConfigError naming it otherwise."""
    codec = CODECS.get(name)
    if codec is None:
        raise ConfigError(f"unknown {what} {name!r}; choose one of {', '.join(CODECS)}")
    if codec.entropy != "none":
        try:
            _zstd()
        except ImportError as exc:
            raise ConfigError(f"{what} {name!r} needs the zstandard package: pip install zstandard") from exc
    return codec
