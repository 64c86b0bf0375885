"""The cluster's pins (`POST /v1/kv/pin` on `kvpool conductor`): what every instance should
retain, kept so that an instance that was down, restarted or missed the fan-out is sent it when
it (re)joins, until it is unpinned or runs out. Pure: time comes in as `now`.

A pin is kept by its prefix (the token ids of the full blocks it covers, under its salt) and
known by the chained hash of its last block; pinning it again merges as an instance's table
does (the later end, the higher priority). Who holds what is confirmed per boot id: a restarted
process (new boot id) has lost its pins and is owed them all again. An unpin releases the
blocks of its prompt on the instances, as on one; the book drops every pin sharing its first
block (that block released, the pin's prefix no longer matches from block 0 anywhere) and owes
the unpin to every instance until it confirms it, for as long as it keeps the boot id it had.
The driver records a pin or an unpin before sending it (so a replay never sends what it
replaces) and undoes the record when no instance took it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool.core.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class ClusterPin:
    """One pin. Frozen: a merge makes a new record, so a confirmation of the one before it (a
    replay in flight) is ignored and the merged one is sent again."""

    key: BlockHash  # the last pinned block's chained hash
    first: BlockHash  # block 0's: unpins match on it
    ids: tuple[int, ...]  # the token ids of the full blocks pinned
    salt: str | None
    until: float  # the conductor's clock; inf: until unpinned
    priority: int
    holders: dict[str, str] = field(default_factory=dict)  # instance -> boot id that confirmed it

    def ttl_left(self, now: float) -> float | None:
        """Seconds left at `now` (None: until unpinned)."""
        return None if math.isinf(self.until) else self.until - now


@dataclass(slots=True)
class ClusterUnpin:
    """An unpin owed to instances that missed it (`owed_to`: instance -> the boot id it had)."""

    first: BlockHash
    ids: tuple[int, ...]
    salt: str | None
    until: float  # after it, the instances have let the dropped pins run out themselves
    owed_to: dict[str, str]


class PinBook:
    """The live pins by key, and the unpins still owed."""

    __slots__ = ("_pins", "_unpins")

    def __init__(self) -> None:
        self._pins: dict[BlockHash, ClusterPin] = {}
        self._unpins: list[ClusterUnpin] = []

    def pins(self, now: float) -> list[ClusterPin]:
        """The pins live at `now`."""
        return [p for p in self._pins.values() if p.until > now]

    def pin(self, key: BlockHash, first: BlockHash, ids: tuple[int, ...], salt: str | None, until: float,
            priority: int) -> tuple[ClusterPin, ClusterPin | None]:
        """Record a pin, merged into an earlier one of the same prefix (whose holders keep it if
        the merge changes nothing); returns it and the record it replaced, for `undo_pin`."""
        old = self._pins.get(key)
        merged = (until, priority) if old is None else (max(until, old.until), max(priority, old.priority))
        held = dict(old.holders) if old is not None and (old.until, old.priority) == merged else {}
        record = self._pins[key] = ClusterPin(key, first, ids, salt, merged[0], merged[1], held)
        return record, old

    def undo_pin(self, record: ClusterPin, before: ClusterPin | None) -> None:
        """No instance took `record`: back to the record it replaced (if nothing replaced it since)."""
        if self._pins.get(record.key) is record:
            if before is None:
                del self._pins[record.key]
            else:
                self._pins[record.key] = before

    def unpin(self, first: BlockHash, ids: tuple[int, ...], salt: str | None,
              owed_to: Mapping[str, str]) -> tuple[list[ClusterPin], ClusterUnpin]:
        """Drop every pin sharing block 0 `first`; owe the unpin (of `ids` under `salt`) to
        `owed_to` (instance -> its boot id) until each confirms it. Returns the dropped pins and
        the unpin, for `undo_unpin`."""
        dropped = [p for p in self._pins.values() if p.first == first]
        for p in dropped:
            del self._pins[p.key]
        until = max((p.until for p in dropped), default=math.inf)
        record = ClusterUnpin(first, ids, salt, until, dict(owed_to))
        self._unpins.append(record)
        return dropped, record

    def undo_unpin(self, dropped: list[ClusterPin], record: ClusterUnpin) -> None:
        """No instance took the unpin: its pins are back (unless pinned again since), it is not owed."""
        for p in dropped:
            self._pins.setdefault(p.key, p)
        record.owed_to.clear()

    def owed(self, instance: str, boot: str, now: float) -> list[ClusterPin | ClusterUnpin]:
        """What `instance`, running as `boot`, still needs: the unpins it missed, then the live
        pins it has not confirmed. Drops what ran out and unpins owed to an earlier boot."""
        self.expire(now)
        for u in self._unpins:
            if u.owed_to.get(instance, boot) != boot:
                del u.owed_to[instance]  # restarted since: its pins are gone anyway
        self._unpins = [u for u in self._unpins if u.owed_to]
        unpins: list[ClusterPin | ClusterUnpin] = [u for u in self._unpins if u.owed_to.get(instance) == boot]
        return unpins + [p for p in self._pins.values() if p.holders.get(instance) != boot]

    def confirm(self, op: ClusterPin | ClusterUnpin, instance: str, boot: str) -> None:
        """`instance` (as `boot`) took `op`. A pin merged or dropped since it was sent is not
        confirmed (a merged one is owed again; a dropped one's unpin is owed after it)."""
        if isinstance(op, ClusterUnpin):
            if op.owed_to.get(instance) == boot:
                del op.owed_to[instance]
            return
        if self._pins.get(op.key) is op:
            op.holders[instance] = boot
            self._supersede(op.first, {instance: boot})

    def expire(self, now: float) -> None:
        """Forget pins and owed unpins whose time has come: each instance runs its TTLs out itself."""
        self._pins = {k: p for k, p in self._pins.items() if p.until > now}
        self._unpins = [u for u in self._unpins if u.until > now and u.owed_to]

    def _supersede(self, first: BlockHash, took: Mapping[str, str]) -> None:
        """Instances that took a pin of block 0 `first` no longer owe an older unpin of it (sent
        later, it would release the newer pin)."""
        for u in self._unpins:
            if u.first == first:
                for inst, boot in took.items():
                    if u.owed_to.get(inst) == boot:
                        del u.owed_to[inst]

    def __len__(self) -> int:
        return len(self._pins)
