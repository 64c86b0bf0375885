"""Byte sizes from text, for every size flag (KV budgets, swap space, store tiers)."""

from __future__ import annotations

import re

from kvpool.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "t": 1000**4, "tb": 1000**4}


def parse_bytes(value: str | int | float, what: str, available: int | None = None) -> int:
    """'2GiB', '512MB', '1048576' -> bytes; a number in (0, 1] is a fraction of `available`."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        text = str(value)
    else:
        text = str(value).strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
    if not m or m.group(2) not in _UNITS:
        raise ConfigError(f"{what}: cannot read {value!r} as a size (e.g. 2GiB, 512MB, 0.3)")
    number = float(m.group(1))
    if not m.group(2) and 0 < number <= 1 and "." in m.group(1):
        if available is None:
            raise ConfigError(f"{what}: a fraction ({value}) needs a known memory size")
        return int(number * available)
    return int(number * _UNITS[m.group(2)])
