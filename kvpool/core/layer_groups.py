"""Layers grouped by attention type, so windowed layers can free their old KV blocks.

A model's layers split into groups of equal size, each group of one window (None = full
attention). Every group has its own block table per sequence, but all groups draw block ids
from one shared pool: a pool block holds the KV of `group_size` layers, and the layer at
position j of any group stores it in the j-th of `group_size` shared KV tensors. So a window
block freed by one request is a block any other request (and any group) can take, and the
pool is never split ahead of time. Equal sizes come from the gcd of the per-window layer
counts (Gemma-3's 5 local : 1 global, 18 layers -> 6 groups of 3 layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

from kvpool.errors import ConfigError


@dataclass(slots=True, frozen=True)
class LayerGroups:
    """`windows[g]`: group g's window; layer l lives in group `layer_group[l]` at tensor
    `layer_slot[l]` (0 <= slot < group_size)."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        return len(self.layer_group) // len(self.windows)


def group_layers(layer_windows: Sequence[int | None], num_layers: int, swa_freeing: bool = True) -> LayerGroups:
    """Groups for a model whose layer l has window `layer_windows[l]` (empty: all full).
    Without `swa_freeing` every layer is one group that keeps every block (windows still
    apply in attention, not to memory)."""
    windows = tuple(layer_windows) or (None,) * num_layers
    if len(windows) != num_layers or num_layers < 1:
        raise ConfigError(f"{len(windows)} layer windows for {num_layers} layers")
    if not swa_freeing or len(set(windows)) == 1:
        only = windows[0] if swa_freeing else None
        return LayerGroups((only,), (0,) * num_layers, tuple(range(num_layers)))
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)  # full attention first
    size = 0
    for w in kinds:
        size = gcd(size, windows.count(w))
    group_windows: list[int | None] = []
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for w in kinds:
        layers = [i for i, x in enumerate(windows) if x == w]
        for start in range(0, len(layers), size):
            g = len(group_windows)
            group_windows.append(w)
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = g, slot
    return LayerGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot))
