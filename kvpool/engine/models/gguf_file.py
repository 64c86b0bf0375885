"""A GGUF file's metadata and tensors, read straight from a memory map.

`gguf.GGUFReader` builds a numpy view per array element: a 262k-token vocabulary (Gemma-3)
takes minutes to open. Here metadata arrays become python lists or one numpy array in one
pass, and tensors stay byte views of the map until `gguf.quants.dequantize` turns them to float.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.errors import ConfigError

_SCALARS = {  # GGUF value type -> struct code
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    qtype: int  # gguf.GGMLQuantizationType value
    data: np.ndarray  # raw bytes, [rows, bytes per row]


class GGUFFile:
    """`fields`: every metadata key -> python value (arrays as lists, numeric arrays as lists of
    numbers); `tensors`: in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        self._pos = 0
        magic, version = self._take("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ConfigError(f"{self.path}: not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        n_tensors, n_fields = self._take("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._take("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._take("<I")
            shape = self._take(f"<{n_dims}Q")
            qtype, offset = self._take("<IQ")
            infos.append((name, tuple(int(d) for d in shape), int(qtype), int(offset)))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _take(self, fmt: str) -> tuple[Any, ...]:
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._take("<Q")
        s = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._take("<" + _SCALARS[kind])[0]
        if kind != _ARRAY:
            raise ConfigError(f"{self.path}: unknown GGUF value type {kind}")
        elem, count = self._take("<IQ")
        if elem in _NUMPY:
            dtype = np.dtype(_NUMPY[elem]).newbyteorder("<")
            arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
            self._pos += arr.nbytes
            return arr.tolist()
        return [self._value(elem) for _ in range(count)]

    def _tensor(self, start: int, name: str, shape: tuple[int, ...], qtype: int, offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        row = shape[0]
        if row % block:
            raise ConfigError(f"GGUF tensor {name!r}: row of {row} is not a multiple of {block}")
        rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        row_bytes = row // block * size
        at = start + offset
        data = self._map[at : at + rows * row_bytes].reshape(rows, row_bytes)
        return GGUFTensor(name, shape, qtype, data)
