"""Layer-wise loading of store hits, the pure part: what lands in the device cache layer by layer
during a step, and what that overlap is worth.

A store block holds every layer's K/V (a layer group's, for a layer-grouped model) under one CRC, so a block is known good only once it is
read whole. The plan is therefore made from blocks already read and checked (`landed`: how many
of each `KVLoad`'s blocks did): the scheduler has already been told how many tokens are cached
(`finish_kv_load`), and the forward pass only waits, before layer l, for layer l of those blocks
to be written into the device cache. What overlaps compute is that write (the host->device
transfer); a block that failed to read is not in the plan and is recomputed, as on the
whole-block path. The engine's loader writes in `layers()` order; the simulator costs the same
plan with `overlap_timeline`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.errors import ConfigError
from kvpool.sched.output import KVLoad


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """Block `index` of load `load` (as read from the store) goes to device block `block_id`."""

    load: int
    index: int
    block_id: int


@dataclass(frozen=True, slots=True)
class LayerwisePlan:
    """The device blocks one forward pass fills from store reads, layer 0 first: the forward
    computes layer l once layer l's K and V of every write has landed."""

    writes: tuple[BlockWrite, ...]
    num_layers: int  # the layers a block holds: a layer group's, when the model has several
    layer_slot: tuple[int, ...] = ()  # model layer -> the block layer it reads (empty: the same index)

    @property
    def num_blocks(self) -> int:
        return len(self.writes)

    @property
    def block_ids(self) -> list[int]:
        return [w.block_id for w in self.writes]

    def layers(self) -> range:
        """The order the loader writes (and signals) layers in: the order the forward needs them."""
        return range(self.num_layers if self.writes else 0)

    def slot_of(self, layer: int) -> int | None:
        """The block layer that model layer `layer` reads (None: none of this plan's). With layer
        groups, block layer j holds layer j of every group, so writing it serves all of them."""
        if self.layer_slot:
            return self.layer_slot[layer] if layer < len(self.layer_slot) else None
        return layer if layer < self.num_layers else None


def plan_layerwise(loads: Sequence[KVLoad], landed: Sequence[int], num_layers: int,
                   layer_slot: Sequence[int] = ()) -> LayerwisePlan:
    """The writes of the loads whose first `landed[i]` blocks were read and checked; the blocks
    after a load's first failure are left out (their tokens are recomputed). A layer-grouped
    model's blocks hold `num_layers` layers of one group; `layer_slot[l]` is model layer l's."""
    if len(loads) != len(landed):
        raise ConfigError(f"{len(loads)} loads but {len(landed)} landed counts")
    if num_layers < 1:
        raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
    if any(not 0 <= j < num_layers for j in layer_slot):
        raise ConfigError(f"layer slots {tuple(layer_slot)} name a block layer outside 0..{num_layers - 1}")
    writes = []
    for i, (load, n) in enumerate(zip(loads, landed, strict=True)):
        if not 0 <= n <= len(load.block_ids):
            raise ConfigError(f"load {load.load_id} landed {n} blocks of {len(load.block_ids)}")
        writes += [BlockWrite(i, j, load.block_ids[j]) for j in range(n)]
    return LayerwisePlan(tuple(writes), num_layers, tuple(layer_slot))


@dataclass(frozen=True, slots=True)
class LayerTimeline:
    """Per layer, when its KV finished landing and when its compute started and ended (seconds
    from the start of the forward pass)."""

    loaded: tuple[float, ...]
    compute_start: tuple[float, ...]
    compute_end: tuple[float, ...]

    @property
    def total_s(self) -> float:
        return self.compute_end[-1] if self.compute_end else 0.0


def overlap_timeline(transfer_s: Sequence[float], compute_s: Sequence[float]) -> LayerTimeline:
    """Layer-wise: layers load one after another over one link while layer l computes once it
    and layer l-1 are done: start[l] = max(end[l-1], loaded[l])."""
    if len(transfer_s) != len(compute_s):
        raise ConfigError(f"{len(transfer_s)} transfer times but {len(compute_s)} compute times")
    loaded, starts, ends = [], [], []
    link = end = 0.0
    for t, c in zip(transfer_s, compute_s, strict=True):
        link += t
        start = max(end, link)
        end = start + c
        loaded.append(link)
        starts.append(start)
        ends.append(end)
    return LayerTimeline(tuple(loaded), tuple(starts), tuple(ends))


def whole_block_time(transfer_s: Sequence[float], compute_s: Sequence[float]) -> float:
    """The whole-block path: every layer lands before the forward starts."""
    return sum(transfer_s) + sum(compute_s)
