"""Lossy KV quantizers of the store's int8 / int4 codecs (the lecture's CacheGen line), in numpy.

They work on float blocks `[layers, 2 (K, V), block_size, kv_heads, head_dim]` and give, per
layer, one "plain" byte string (codes, then float16 parameters) that the codec may entropy-code.
Groups never cross a layer, so each layer's plain bytes dequantize on their own.
- int8: K and V per token-and-head (one group of head_dim channels), symmetric, q in [-127, 127].
- int4: K per channel over the block's tokens (KIVI: K's outliers sit in fixed channels, so a
  channel's values share a range; 3.1% relative error vs 13% per token on SmolLM2's KV), V per
  token-and-head; both asymmetric (min + scale), q in [0, 15], two codes per byte.
Scales are float16 rounded up (and minima rounded down), so no value leaves its code range.
Dequantized value = float32(q) * scale (+ min), then rounded to the block's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpool.errors import ConfigError

_F16 = np.dtype("<f2")
FLOAT_DTYPES = ("<f4", "<f2", "<u2")  # float32, float16, bfloat16 (travels as its uint16 bit pattern)


class Unquantizable(ValueError):
    """A block holds values a float16-scaled code cannot carry (inf, NaN, beyond float16)."""


def to_float32(x: np.ndarray) -> np.ndarray:
    """The store dtype's values as float32 (uint16 is a bfloat16 bit pattern)."""
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def from_float32(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float32 values in the store dtype, rounded to nearest even (bfloat16 as its bits)."""
    if dtype == np.uint16:
        u = np.ascontiguousarray(x, np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return x.astype(dtype)


def _f16(x: np.ndarray, up: bool) -> np.ndarray:
    """float16 nearest to `x` on the safe side: >= x when `up`, else <= x."""
    h = x.astype(_F16)
    off = h.astype(np.float32) < x if up else h.astype(np.float32) > x
    h[off] = np.nextafter(h[off], _F16.type(np.inf if up else -np.inf))
    return h


def _scale(span: np.ndarray, qmax: int) -> np.ndarray:
    return np.where(span > 0, _f16(span / qmax, up=True), _F16.type(1.0))


def _asym(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """4-bit codes of `x` with one (min, scale) per slice along `axis`."""
    lo = _f16(x.min(axis=axis, keepdims=True), up=False)
    scale = _scale(x.max(axis=axis, keepdims=True) - lo.astype(np.float32), 15)
    q = np.clip(np.rint((x - lo.astype(np.float32)) / scale.astype(np.float32)), 0, 15).astype(np.uint8)
    return q, lo, scale


@dataclass(frozen=True, slots=True)
class Quantizer:
    name: str  # int8 | int4

    def check_shape(self, shape: tuple[int, ...], dtype: np.dtype | str) -> None:
        """ConfigError unless blocks of `shape` / `dtype` are float KV blocks this quantizer takes."""
        dt = np.dtype(dtype)
        if dt.str not in FLOAT_DTYPES:
            raise ConfigError(f"the {self.name} codec quantizes float KV (float32, float16, bfloat16); "
                              f"these blocks are {dt} (a quantized KV cache is stored as it is)")
        if len(shape) != 5 or shape[1] != 2 or (self.name == "int4" and shape[-1] % 2):
            raise ConfigError(f"the {self.name} codec needs [layers, 2, block_size, heads, head_dim] blocks "
                              f"(even head_dim for int4), got {shape}")

    def plain_size(self, layer: tuple[int, ...]) -> int:
        """Bytes of one layer's plain encoding; `layer` is [2, B, H, D]."""
        _, b, h, d = layer
        if self.name == "int8":
            return 2 * b * h * d + 2 * 2 * b * h
        return b * h * d + 2 * 2 * h * d + 2 * 2 * b * h

    def pack(self, x: np.ndarray) -> list[bytes]:
        """Per layer of `x` ([n, 2, B, H, D] float32), its plain bytes; Unquantizable if a value
        cannot be carried."""
        if not np.isfinite(x).all():
            raise Unquantizable("block holds inf or NaN")
        if np.abs(x).max(initial=0.0) > 6e4:
            raise Unquantizable("block holds values beyond float16's range")
        if self.name == "int8":
            scale = _scale(np.abs(x).max(axis=-1, keepdims=True), 127)
            q = np.clip(np.rint(x / scale.astype(np.float32)), -127, 127).astype(np.int8)
            return [q[i].tobytes() + scale[i].tobytes() for i in range(len(x))]
        qk, klo, ks = _asym(x[:, 0], axis=1)  # per channel: over the block's tokens
        qv, vlo, vs = _asym(x[:, 1], axis=-1)  # per token and head
        q = np.stack((qk, qv), axis=1)
        codes = q[..., 0::2] | (q[..., 1::2] << 4)
        return [codes[i].tobytes() + klo[i].tobytes() + ks[i].tobytes() + vlo[i].tobytes() + vs[i].tobytes()
                for i in range(len(x))]

    def unpack(self, plain: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        """float32 `[n, 2, B, H, D]` from n layers' plain bytes, concatenated."""
        n, _, b, h, d = shape
        rows = np.frombuffer(plain, np.uint8).reshape(n, -1)
        if self.name == "int8":
            q = rows[:, : 2 * b * h * d].view(np.int8).reshape(n, 2, b, h, d)
            scale = rows[:, 2 * b * h * d :].view(_F16).reshape(n, 2, b, h, 1)
            return q.astype(np.float32) * scale.astype(np.float32)
        at = b * h * d
        codes = rows[:, :at].reshape(n, 2, b, h, d // 2)
        q = np.empty((n, 2, b, h, d), np.uint8)
        q[..., 0::2], q[..., 1::2] = codes & 0xF, codes >> 4
        params = rows[:, at:]
        kp = params[:, : 4 * h * d].view(_F16).astype(np.float32).reshape(n, 2, 1, h, d)
        vp = params[:, 4 * h * d :].view(_F16).astype(np.float32).reshape(n, 2, b, h, 1)
        out = q.astype(np.float32)
        out[:, 0] = out[:, 0] * kp[:, 1] + kp[:, 0]
        out[:, 1] = out[:, 1] * vp[:, 1] + vp[:, 0]
        return out


QUANTIZERS = {name: Quantizer(name) for name in ("int8", "int4")}
