"""Linear layers, one interface (`forward(x)`, `warm_up(max_rows)`) in four forms the loader
picks from per projection (`packing.py`): the checkpoint's dense weight, a oneDNN-packed copy,
and 4-bit or 8-bit groups that serve decode-sized batches beside a dense copy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CheckpointLinear(nn.Linear):
    """An nn.Linear allocated but not initialized: `load_weights` fills every parameter (and
    refuses a checkpoint that misses one). Random init under the meta device runs torch's
    Python decompositions, whose first use imports ~3 s of modules into every process."""

    def reset_parameters(self) -> None:
        pass

    def warm_up(self, max_rows: int) -> None:
        """Nothing to build: `F.linear` has no per-shape kernels to prepare."""


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """`x` with zero rows appended up to `rows` (itself when it has them)."""
    extra = rows - x.shape[0]
    return x if extra <= 0 else torch.cat((x, x.new_zeros(extra, *x.shape[1:])))


def row_bucket(rows: int) -> int:
    """Rows padded to one of few sizes: oneDNN builds a kernel per new shape (~0.7 ms per
    projection), which would tax every step whose token count is new. Small batches round up
    to a multiple of 8 (nearly free: weight-bandwidth bound), larger ones by at most 1/8 (49
    shapes up to 2304 rows)."""
    step = max(8, 1 << max(0, (rows - 1).bit_length() - 4))
    return -(-rows // step) * step


class FrozenLinear(nn.Module):
    """`F.linear` on a frozen weight: the dense copy where oneDNN cannot pack the dtype."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def warm_up(self, max_rows: int) -> None:
        """Nothing to build (see `CheckpointLinear.warm_up`)."""


class PackedLinear(nn.Module):
    """A frozen Linear whose weight is pre-packed for oneDNN's CPU GEMM: the blocked layout
    streams weights 1.2-3x faster than `F.linear`, most at decode batch sizes (vLLM's CPU
    backend does the same). Results match `F.linear` to float rounding."""

    def __init__(self, weight: Tensor, bias: Tensor | None, batch_hint: int = 8) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        self.bias = None if bias is None else bias.detach()
        self.in_features = weight.shape[1]

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        x = pad_rows(x, row_bucket(rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:rows]

    def warm_up(self, max_rows: int) -> None:
        """Build the kernel of every row bucket up to `max_rows` now, not in a served step."""
        rows = 1
        while rows <= max_rows:
            bucket = row_bucket(rows)
            self(torch.zeros(bucket, self.in_features, dtype=self.packed.dtype))
            rows = bucket + 1


def can_pack_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    """oneDNN packs float32 weights on any x86 CPU, bf16 ones only where it has a bf16 GEMM
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): elsewhere a bf16 model keeps `F.linear`."""
    return (
        torch.device(device).type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class Q4Linear(nn.Module):
    """A frozen Linear with two copies of its weight: 4-bit groups (`models/quantized.py`) for
    batches of at most `max_rows` rows (weight-bandwidth bound), the dense module for larger
    ones. Batches of up to `vector_rows` (default: all of them) run the vector kernel, float32
    or bfloat16, larger ones the AMX kernel (bfloat16). Results come back in the activations' dtype."""

    def __init__(
        self,
        dense: FrozenLinear | PackedLinear,
        groups: tuple[Tensor, ...],
        bias: Tensor | None,
        max_rows: int,
        vector_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.dense = dense
        self.groups = groups
        self.bias = bias
        self.max_rows = max_rows
        self.vector_rows = max_rows if vector_rows is None else vector_rows

    def kernel(self, x: Tensor) -> Tensor:
        return torch.ops.kvpool.q4_linear(x, *self.groups)

    def tile_kernel(self, x: Tensor) -> Tensor:
        return torch.ops.kvpool.q4_linear_amx(x, *self.groups)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        if rows > self.max_rows:
            return self.dense(x)
        y = self.kernel(x) if rows <= self.vector_rows else self.tile_kernel(x)
        return y if self.bias is None else y + self.bias

    def warm_up(self, max_rows: int) -> None:
        """The dense copy's kernels (the groups' kernels take any row count as built)."""
        self.dense.warm_up(max_rows)


class Q8Linear(Q4Linear):
    """The same over Q8_0 groups (the LM head)."""

    def kernel(self, x: Tensor) -> Tensor:
        return torch.ops.kvpool.q8_linear(x, *self.groups)

    def tile_kernel(self, x: Tensor) -> Tensor:
        return torch.ops.kvpool.q8_linear_amx(x, *self.groups)
