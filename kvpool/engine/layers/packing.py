"""Which linear layer serves each projection, chosen once the weights are loaded (CPU).

Every projection (and the LM head) becomes a oneDNN-packed copy, or a plain frozen one where
oneDNN cannot pack the dtype (bf16 on AVX2); the embedding table stays as it is for the lookup.
With 4-bit kernels, a projection whose weights are exactly 4-bit groups also keeps those for
small batches (`Q4Linear`), and the LM head its exact Q8_0 groups (`Q8Linear`), float32 or
bfloat16. Batch-invariant (the default, see `kernels.batch_invariant`): groups serve only where
their kernel gives the dense GEMM's bits (the lanes kernels, `lanes_groups`, or on AMX CPUs the
tile kernel, `tile_groups`), so the row count never changes a row; on AMX CPUs in bf16 the dense
copies are `TileLinear`s too (oneDNN's order depends on the row count there), and Q4_1 groups,
repacked in the tiles' order, serve every step (`Q4TileLinear`, the dense copy dropped once checked),
Q8_0 ones (the LM head) up to `TILES_MAX_ROWS_BF16` (`Q8TileLinear`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from tqdm import tqdm

from kvpool.engine.kernels import batch_invariant, q4_amx_available, q4_linear_available
from kvpool.engine.layers.linear import (
    EVERY_ROW_COUNT,
    FrozenLinear,
    PackedLinear,
    Q4Linear,
    Q4TileLinear,
    Q8Linear,
    Q8TileLinear,
    TileLinear,
    can_pack_weights,
)
from kvpool.engine.models.quantized import (
    TILES_MAX_ROWS_BF16,
    lanes_groups,
    row_limits,
    tile_groups,
)

logger = logging.getLogger(__name__)

# Row buckets worth building before the first step: a kernel's build costs ~1.5-2 ms whatever
# the rows (measured, one thread), most of an 8-row projection's time but under a tenth of a
# 256-row one's, so larger buckets build on first use. Building all 49 took 7 s a process.
WARM_UP_ROWS = 256
WARM_UP_LAYER_WEIGHTS = 3_538_944  # ... for a layer of this many weights (SmolLM2-135M's)


class LinearPacker:
    """Picks each projection's layer, taking its exact groups out of `quant_groups` (module
    name -> groups, from the loader) as it goes, so they are dropped as they are repacked."""

    def __init__(self, dtype: torch.dtype, q4_kernels: bool, quant_groups: dict[str, tuple[Tensor, ...]]) -> None:
        self.dtype = dtype
        self.dense = PackedLinear if can_pack_weights("cpu", dtype) else FrozenLinear
        self.invariant = batch_invariant()
        q4_kernels = q4_kernels and q4_linear_available()
        if self.invariant and self.dense is not PackedLinear:
            q4_kernels = False  # no kernel reproduces the unpacked GEMM's order
        self.q4_kernels = q4_kernels
        self.groups = quant_groups
        self.bf16 = dtype == torch.bfloat16
        self.vector_rows, self.max_rows = row_limits(self.bf16, invariant=self.invariant) if q4_kernels else (0, 0)
        self.q8_rows = row_limits(self.bf16, invariant=self.invariant, bits=8) if q4_kernels else (0, 0)
        # batch-invariant bf16 on AMX: projections on the tile kernel at every row count (TileLinear)
        self.tiles = self.invariant and self.bf16 and self.dense is PackedLinear and q4_amx_available()
        self.served: list[Q4Linear] = []  # projections that serve small batches from their groups

    def linear(self, name: str, weight: Tensor, bias: Tensor | None) -> nn.Module:
        """The layer for projection `name` (Q4_1 groups, or Q8_0 ones quantized on load)."""
        dense = (TileLinear if self.tiles and TileLinear.fits(weight) else self.dense)(weight, bias)
        groups = self._exact(name, dense, (3, 2))
        if groups is None:
            return dense
        if self.tiles:  # repacked by tile_groups
            layer: Q4Linear = (Q4TileLinear(groups, dense.bias) if len(groups) == 3
                               else Q8TileLinear(dense, groups, dense.bias, TILES_MAX_ROWS_BF16))
        else:
            four = len(groups) == 3
            kind, (vector, most) = (Q4Linear, (self.vector_rows, self.max_rows)) if four else (Q8Linear, self.q8_rows)
            every = most == EVERY_ROW_COUNT  # the groups serve every batch: no dense copy
            layer = kind(None if every else dense, groups, dense.bias, most, vector)
        self.served.append(layer)
        return layer

    def head(self, name: str, weight: Tensor) -> nn.Module:
        """The LM head's layer: dense, or its Q8_0 groups for small batches."""
        dense = (TileLinear if self.tiles and TileLinear.fits(weight) else self.dense)(weight, None)
        groups = self._exact(name, dense, (2,))
        if groups is None:
            return dense
        if self.tiles:  # repacked by tile_groups
            return Q8TileLinear(dense, groups, None, TILES_MAX_ROWS_BF16)
        vector, most = row_limits(self.bf16, head=True, invariant=self.invariant)
        return Q8Linear(dense, groups, None, most, vector) if most else dense

    @property
    def q4_rows(self) -> int:
        """Batches up to this many rows run on groups (0: none do)."""
        return max((layer.max_rows for layer in self.served), default=0)

    def _exact(self, name: str, dense: nn.Module, sizes: tuple[int, ...]) -> tuple[Tensor, ...] | None:
        groups = self.groups.pop(name, None)
        if not self.q4_kernels or groups is None or len(groups) not in sizes:
            return None
        if self.invariant:
            if getattr(dense, "bias", None) is not None:
                return None
            if self.vector_rows == 0:  # the AMX tile kernel alone (row_limits)
                return tile_groups(dense, groups)
            return lanes_groups(dense, groups, self.dtype)
        return groups

    def report(self, projections: int, head: nn.Module, native_loop: bool) -> None:
        if not self.q4_kernels:
            return
        rows = "every batch" if self.q4_rows == EVERY_ROW_COUNT else f"batches of <= {self.q4_rows} rows"
        logger.info("%d of %d projections also serve %s from 4-bit groups%s%s", len(self.served), projections, rows,
                    f"; the LM head <= {head.max_rows} rows from 8-bit groups" if isinstance(head, Q8Linear) else "",
                    " (bit for bit the dense GEMM's results)" if self.invariant else "")
        logger.info("decode-sized steps run %s", "the native layer loop" if native_loop else "the Python layer loop")


def warm_up(layer_linears: Sequence[nn.Module], head: nn.Module, layer_weights: int, max_tokens: int,
            max_logit_rows: int) -> None:
    """Pre-build oneDNN kernels for the padded sizes a step can produce up to WARM_UP_ROWS,
    fewer for layers larger than SmolLM2-135M's (one layer's projections suffice: kernels are
    shared by shape)."""
    # the LM head is ~16x a projection: its build is a tenth of its matmul by ~32 rows. A
    # larger model's matmuls outgrow the build sooner: the limits shrink with its layer.
    rows = max(8, WARM_UP_ROWS * WARM_UP_LAYER_WEIGHTS // layer_weights)
    max_tokens, max_logit_rows = min(max_tokens, rows), min(max_logit_rows, max(8, rows // 4))
    for lin in tqdm(layer_linears, desc="building CPU kernels", unit="shape", leave=False, disable=None):
        lin.warm_up(max_tokens)
    head.warm_up(max_logit_rows)
