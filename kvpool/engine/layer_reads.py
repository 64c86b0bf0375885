"""The layer-wise loader's reads: layer l of every planned block, read from its tier and checked
(kvpool/store/layered.py) on the loader thread, so the read of layer l+1 overlaps the forward's
layer l. A block whose layer fails is not written from then on, nor are the later blocks of its
load (their tokens are recomputed); `failed` names, per load, the first bad block and the miss
reason, for the connector to rewind that sequence (kvpool/core/rewind.py) after the forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvpool.core.miss_reasons import INTEGRITY, LOAD_FAILED
from kvpool.sched.layerwise import BlockWrite, LayerwisePlan
from kvpool.store.format import CorruptBlock
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.layered import LayeredBlock, LayerUnavailable

logger = logging.getLogger(__name__)


class LayerReads:
    """Reads of `plan`'s blocks (`blocks[i]` for `plan.writes[i]`: arrays, checked blocks or
    layered blocks), one layer at a time."""

    def __init__(self, plan: LayerwisePlan, blocks: Sequence, store: TieredKVStore) -> None:
        if len(blocks) != plan.num_blocks:
            raise ValueError(f"{len(blocks)} blocks for a plan of {plan.num_blocks} writes")
        self.plan = plan
        self.blocks = list(blocks)
        self.store = store
        self.failed: dict[int, tuple[int, str]] = {}  # load -> (its first bad block's index, why)

    def layer(self, layer: int) -> tuple[list[int], list[np.ndarray]]:
        """Block layer `layer` of every block still good: the device blocks and their data."""
        ids, arrays = [], []
        for w, block in zip(self.plan.writes, self.blocks, strict=True):
            if not self._good(w):
                continue
            try:
                arrays.append(block[layer])
            except (CorruptBlock, LayerUnavailable) as exc:
                self._fail(w, block, layer, exc)
                continue
            ids.append(w.block_id)
        return ids, arrays

    def give_up(self) -> None:
        """The forward stopped waiting for these reads: every load recomputes from its first block."""
        for load in {w.load for w in self.plan.writes}:
            self.failed[load] = (0, LOAD_FAILED)

    def finish(self) -> None:
        """Every layer was read: the store measures each block read whole (and promotes it)."""
        for w, block in zip(self.plan.writes, self.blocks, strict=True):
            if isinstance(block, LayeredBlock) and self._good(w):
                self.store.finish_layered(block)

    def _good(self, w: BlockWrite) -> bool:
        bad = self.failed.get(w.load)
        return bad is None or w.index < bad[0]

    def _fail(self, w: BlockWrite, block, layer: int, exc: Exception) -> None:
        logger.warning("KV store block %d of load %d failed at layer %d under the forward (%s); its sequence "
                       "recomputes from there", w.index, w.load, layer, exc)
        if isinstance(block, LayeredBlock):
            self.store.reject_layered(block, exc)
        self.failed[w.load] = (w.index, INTEGRITY if isinstance(exc, CorruptBlock) else LOAD_FAILED)
