"""Each evictable key's latest stamp, for `LRUPolicy` (core/policies.py): an entry of its log is
live while its key's stamp is the entry's. Any hashable keys in a dict, or a pool's block ids
(the ints below a size) in a list slot each, with no hashing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from itertools import repeat


class DictStamps:
    """Each evictable key's stamp, for any hashable keys."""

    def __init__(self) -> None:
        self._stamp_of: dict[Hashable, object] = {}

    def live(self, keys: Iterable[Hashable], stamps: Iterable[object]) -> list[Hashable]:
        """The keys whose stamp is the one at the same position of `stamps`."""
        get = self._stamp_of.get
        return [key for key, stamp in zip(keys, stamps, strict=True) if get(key) is stamp]

    def take(self, keys: Iterable[Hashable], stamps: Iterable[object]) -> list[Hashable]:
        """`live`, and forget those keys (victims: a key has at most one live entry)."""
        stamp_of = self._stamp_of
        out = [key for key, stamp in zip(keys, stamps, strict=True) if stamp_of.get(key) is stamp]
        for key in out:
            del stamp_of[key]
        return out

    def stamps(self, keys: Iterable[Hashable]) -> list[object]:
        """The stamp of each key (all evictable)."""
        return list(map(self._stamp_of.__getitem__, keys))

    def assign(self, keys: list[Hashable], stamp: object) -> bool:
        """Give every key `stamp`; True when a key repeats in `keys`."""
        self._stamp_of.update(zip(keys, repeat(stamp)))
        return len(keys) > 1 and len(set(keys)) < len(keys)

    def assign_new(self, keys: list[Hashable], stamp: object) -> None:
        """`assign` of distinct keys none of which has a stamp."""
        self._stamp_of.update(zip(keys, repeat(stamp)))

    def drop(self, keys: Iterable[Hashable]) -> None:
        """Forget the keys; KeyError at the first one not evictable."""
        stamp_of = self._stamp_of
        for key in keys:
            del stamp_of[key]

    def __contains__(self, key: object) -> bool:
        return key in self._stamp_of

    def __len__(self) -> int:
        return len(self._stamp_of)


class ListStamps:
    """`DictStamps` for the ints 0 .. size-1 (a pool's block ids): a list slot per key
    instead of a dict entry, so no hashing."""

    def __init__(self, size: int) -> None:
        self._stamp_of: list[object | None] = [None] * size
        self._len = 0

    def live(self, keys: Iterable[int], stamps: Iterable[object]) -> list[int]:
        stamp_of = self._stamp_of
        return [key for key, stamp in zip(keys, stamps, strict=True) if stamp_of[key] is stamp]

    def take(self, keys: Iterable[int], stamps: Iterable[object]) -> list[int]:
        # one pass: each victim's slot is read and cleared while it is in cache
        stamp_of = self._stamp_of
        out = []
        for key, stamp in zip(keys, stamps, strict=True):
            if stamp_of[key] is stamp:
                stamp_of[key] = None
                out.append(key)
        self._len -= len(out)
        return out

    def stamps(self, keys: Iterable[int]) -> list[object]:
        stamp_of = self._stamp_of
        return [stamp_of[key] for key in keys]

    def assign(self, keys: list[int], stamp: object) -> bool:
        stamp_of = self._stamp_of
        added = 0
        repeated = False
        for key in keys:
            old = stamp_of[key]
            if old is None:
                added += 1
            elif old is stamp:
                repeated = True
            stamp_of[key] = stamp
        self._len += added
        return repeated

    def assign_new(self, keys: list[int], stamp: object) -> None:
        # a released block's slot, one store each (28M of them over the simulator's trace run)
        stamp_of = self._stamp_of
        for key in keys:
            stamp_of[key] = stamp
        self._len += len(keys)

    def drop(self, keys: Iterable[int]) -> None:
        stamp_of = self._stamp_of
        dropped = 0
        try:
            for key in keys:
                if stamp_of[key] is None:
                    raise KeyError(key)
                stamp_of[key] = None
                dropped += 1
        finally:
            self._len -= dropped

    def __contains__(self, key: object) -> bool:
        return self._stamp_of[key] is not None  # type: ignore[index]

    def __len__(self) -> int:
        return self._len
