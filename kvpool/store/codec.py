"""Payload codecs of a stored KV block: how its raw tensor bytes are packed for a tier.

Measured on real KV blocks of the bundled model (`kvpool bench kvstore --codecs ...`): KV floats
have little byte-level redundancy except in the sign/exponent bytes, so lz4 finds nothing
(ratio <= 1.0) and zstd at level 1 gains ~1.07x (float32) to ~1.26x (bfloat16); grouping
byte planes first (`zstd-shuffle`: byte k of every element together, then zstd) adds ~8%
more at about twice the decode cost. A codec id is one byte of the block header, so a reader
decodes whatever codec the writer chose. Ids below LOSSY_BASE are lossless (decode gives the
exact bytes); ids from LOSSY_BASE up are reserved for quantizing codecs (int8 / fp8 with
scales), whose decode gives an approximation; the header's CRC covers the decoded bytes either
way, so corruption is caught for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from kvpool.errors import ConfigError, KVPoolError

LOSSY_BASE = 64
_ZSTD_LEVEL = 1  # level 3 gained nothing on KV (same ratio to 3 digits) at ~1.5x the encode cost


class CodecError(KVPoolError):
    """A payload does not decode with the codec its header names."""


@dataclass(frozen=True, slots=True)
class Codec:
    name: str
    id: int
    # (raw bytes, element size) -> stored bytes
    encode: Callable[[memoryview, int], bytes]
    # (stored bytes, raw length, element size) -> raw bytes; CodecError if they do not decode
    decode: Callable[[memoryview, int, int], bytes | memoryview]

    @property
    def lossless(self) -> bool:
        return self.id < LOSSY_BASE


def _zstd() -> ModuleType:
    import zstandard  # a declared dependency; imported on use so the store loads without it

    return zstandard


def _shuffle(raw: memoryview, itemsize: int) -> bytes | memoryview:
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
        # cannot make the reader allocate more than one block.
        if zstd.frame_content_size(stored) != raw_len:
            raise CodecError(f"zstd frame does not hold the {raw_len} bytes the header names")
        out = zstd.ZstdDecompressor().decompress(stored, max_output_size=raw_len, allow_extra_data=False)
    except zstd.ZstdError as exc:
        raise CodecError(f"zstd: {exc}") from exc
    if len(out) != raw_len:
        raise CodecError(f"zstd gave {len(out)} bytes, the header names {raw_len}")
    return out


def _identity(data: memoryview, *_: int) -> memoryview:
    return data


CODECS: dict[str, Codec] = {
    "none": Codec("none", 0, _identity, _identity),
    "zstd": Codec("zstd", 1, lambda raw, _: _zstd_encode(raw), lambda s, n, _: _zstd_decode(s, n)),
    "zstd-shuffle": Codec(
        "zstd-shuffle", 2,
        lambda raw, isz: _zstd_encode(_shuffle(raw, isz)),
        lambda s, n, isz: _unshuffle(_zstd_decode(s, n), isz),
    ),
}
BY_ID: dict[int, Codec] = {c.id: c for c in CODECS.values()}


def get_codec(name: str, what: str = "codec") -> Codec:
    """The codec called `name`, usable here; ConfigError naming it otherwise."""
    codec = CODECS.get(name)
    if codec is None:
        raise ConfigError(f"unknown {what} {name!r}; choose one of {', '.join(CODECS)}")
    if codec.name.startswith("zstd"):
        try:
            _zstd()
        except ImportError as exc:
            raise ConfigError(f"{what} {name!r} needs the zstandard package: pip install zstandard") from exc
    return codec
