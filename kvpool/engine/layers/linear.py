"""Linear layers, one interface (`forward(x)`, `warm_up(max_rows)`) in five forms the loader
picks from per projection (`packing.py`): the checkpoint's dense weight, a oneDNN-packed copy,
a copy packed for the AMX tile kernel, and 4-bit or 8-bit groups that serve decode-sized
batches beside a dense copy."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvpool.engine.kernels import batch_invariant


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
    projection), which would tax every step whose token count is new. Up to 256 rows round up
    to a multiple of 8, larger ones by at most 1/16 (82 shapes up to 2304 rows). A prompt
    chunk beside a few decode rows lands just past a power of two: 129 rows used to pad to 144,
    12% more GEMM work (8.6 ms of a bundled-model step, 2-core EPYC), now to 136."""
    step = max(8, 1 << max(0, (rows - 1).bit_length() - 5))
    return -(-rows // step) * step


def bucket_below(bucket: int) -> int:
    """The largest row bucket under `bucket`."""
    rows = bucket - 1
    while row_bucket(rows) >= bucket:
        rows -= 1
    return row_bucket(rows)


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
    backend does the same). Results match `F.linear` to float rounding.

    Batch-invariant (the default): oneDNN picks its kernel per shape, and on AMX CPUs its bf16
    GEMM sums K in one chain for some row buckets and in blocks for others (3072 x 576: one
    chain up to 32 rows, blocks from 40), so a row's bits would depend on how many rows share
    its step. Each bucket therefore runs as is only once it has been checked, on probe rows,
    to give the smallest bucket's bits; a batch in any other bucket runs as chunks of an
    agreeing bucket below it or padded to one above (`AgreeingBuckets`). Batch-invariant bf16
    on AMX, the projections and the LM head use `TileLinear` instead."""

    def __init__(self, weight: Tensor, bias: Tensor | None, batch_hint: int = 8) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        self.bias = None if bias is None else bias.detach()
        self.in_features = weight.shape[1]
        self.buckets = AgreeingBuckets(self._gemm, weight.shape, weight.dtype) if batch_invariant() else None

    row_buckets = True  # takes its rows padded to a `row_bucket` (LlamaForCausal pads them once)

    def _gemm(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        bucket = row_bucket(rows)
        chunk = bucket if self.buckets is None else self.buckets.chunk_rows(bucket)
        if chunk >= rows:
            return self._gemm(pad_rows(x, chunk))[:rows]
        parts = [self._gemm(pad_rows(x[i : i + chunk], chunk)) for i in range(0, rows, chunk)]
        return torch.cat(parts)[:rows]

    def warm_up(self, max_rows: int) -> None:
        """Build the kernel of every row bucket up to `max_rows` now, not in a served step
        (and, batch-invariant, check it)."""
        rows = 1
        while rows <= max_rows:
            bucket = row_bucket(rows)
            self(torch.zeros(bucket, self.in_features, dtype=self.packed.dtype))
            rows = bucket + 1


SMALLEST_BUCKET = 8  # the reference every other bucket is checked against
# Outputs a check compares: another summation order changes a bf16 output only where the float32
# sum lies near a rounding boundary (~1 in 15,000 outputs, bf16 3072 x 576), so a check reads
# about a million, in as many calls as that takes.
PROBE_OUTPUTS = 1 << 20
# (shape, dtype, bucket) -> whether oneDNN's bits there equal the smallest bucket's (its choice
# depends on the shapes alone, so one check serves every layer of a shape)
_bucket_agrees: dict[tuple, bool] = {}
# A GEMM call costs about as much as this many more rows (bf16, AMX: 0.13 ms + 3.4 us a row
# over a layer's four projections of the bundled model)
CALL_ROWS = 38
_probes: dict[tuple, tuple[Callable[[Tensor], Tensor], Tensor, Tensor]] = {}  # shape -> (gemm, rows, their bits)


class AgreeingBuckets:
    """Which row buckets of one packed GEMM give every row the bits it gets in the smallest
    bucket, checked on first use with probe rows; `chunk_rows` the rows a batch of a bucket
    runs at."""

    def __init__(self, gemm: Callable[[Tensor], Tensor], shape: torch.Size, dtype: torch.dtype) -> None:
        self.gemm, self.shape, self.dtype = gemm, tuple(shape), dtype
        self._chunk: dict[int, int] = {}

    def agrees(self, bucket: int) -> bool:
        if bucket <= SMALLEST_BUCKET:
            return True
        key = (self.shape, self.dtype, bucket)
        if key not in _bucket_agrees:
            gemm, x, want = self._probe()
            rows = x.shape[0]
            got = torch.cat([gemm(pad_rows(x[i : i + bucket], bucket))[: rows - i] for i in range(0, rows, bucket)])
            _bucket_agrees[key] = torch.equal(got, want)
        return _bucket_agrees[key]

    def _probe(self) -> tuple[Callable[[Tensor], Tensor], Tensor, Tensor]:
        key = (self.shape, self.dtype)
        if key not in _probes:
            n, k = self.shape
            rows = -(-PROBE_OUTPUTS // n // SMALLEST_BUCKET) * SMALLEST_BUCKET
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n * 7919 + k)).to(self.dtype)
            want = torch.cat([self.gemm(part) for part in x.split(SMALLEST_BUCKET)])
            _probes[key] = (self.gemm, x, want)
        return _probes[key]

    def chunk_rows(self, bucket: int) -> int:
        """The rows a batch of `bucket` runs at: `bucket` where it agrees, else the agreeing
        bucket that costs least, counted as padded rows plus CALL_ROWS per call: chunks of one
        below it, or one call padded to the next above it (up to twice its rows)."""
        if self.agrees(bucket):
            return bucket
        if bucket not in self._chunk:
            best, best_cost = bucket, None
            below = bucket
            while not self.agrees(below):
                below = bucket_below(below)
            candidates = [below]
            above = row_bucket(bucket + 1)
            while above <= 2 * bucket and not self.agrees(above):
                above = row_bucket(above + 1)
            if above <= 2 * bucket:
                candidates.append(above)
            while below > SMALLEST_BUCKET:
                below = bucket_below(below)
                if self.agrees(below):
                    candidates.append(below)
            for rows in candidates:
                cost = -(-bucket // rows) * (rows + CALL_ROWS)
                if best_cost is None or cost < best_cost:
                    best, best_cost = rows, cost
            self._chunk[bucket] = best
        return self._chunk[bucket]


class TileLinear(nn.Module):
    """A frozen bf16 Linear on the AMX tile kernel (`kvpool::bf16_linear_amx`), for batch-
    invariant bf16 on AMX CPUs: every row count sums K in one `tdpbf16ps` chain, the order
    oneDNN keeps only at some row buckets (`AgreeingBuckets`), so no step needs chunks. The
    weight is packed once into the kernel's B tiles (strips of 16 outputs, pairs of K)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.strips = self.pack(weight.detach())
        self.bias = None if bias is None else bias.detach()

    @staticmethod
    def pack(weight: Tensor) -> Tensor:
        """[N, K] -> [N/16 (even), K/32, 16 pairs of K, 16 outputs, 2], zero past N."""
        n, k = weight.shape
        padded = -(-n // 32) * 32
        # a pair of K as one int32 element: the permuting copy runs 2x faster
        pairs = pad_rows(weight.to(torch.bfloat16).contiguous(), padded).view(torch.int32)
        tiles = pairs.view(padded // 16, 16, k // 32, 16).permute(0, 2, 3, 1).contiguous()
        return tiles.view(torch.bfloat16).view(padded // 16, k // 32, 16, 16, 2)

    @staticmethod
    def fits(weight: Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 32 == 0

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.kvpool.bf16_linear_amx(x, self.strips, self.out_features)
        return y if self.bias is None else y + self.bias

    def warm_up(self, max_rows: int) -> None:
        """Nothing to build: the kernel takes any row count."""


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


EVERY_ROW_COUNT = sys.maxsize  # a row limit that is none


class Q4Linear(nn.Module):
    """A frozen Linear with two copies of its weight: 4-bit groups (`models/quantized.py`) for
    batches of at most `max_rows` rows (weight-bandwidth bound), the dense module for larger
    ones (none where the groups serve every row count). Batches of up to `vector_rows` (default:
    all of them) run the vector kernel, float32 or bfloat16, larger ones the AMX kernel
    (bfloat16). Results come back in the activations' dtype."""

    def __init__(
        self,
        dense: FrozenLinear | PackedLinear | None,
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

    @property
    def row_buckets(self) -> bool:
        """Whether batches above `max_rows` take their rows padded to a `row_bucket`."""
        return getattr(self.dense, "row_buckets", False)

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
        if self.dense is not None:
            self.dense.warm_up(max_rows)


class Q4TileLinear(Q4Linear):
    """Q4_1 groups repacked in the AMX B tiles' order (`models/quantized.q4_vnni_repack`) at
    every row count: the dense `TileLinear`'s products in the same order, so the same bits (the
    packer checks them against it, then drops it: 2 bytes a weight against 0.75). The kernel
    reads 0.75 bytes a weight where the dense copy reads 2, and dequantizes each strip pair once
    per 512 rows beside the tile products of the pair before (one thread, the bundled model's
    120 projections out of cache: 128 rows 29.7 vs 35.7 ms, 1,088 rows 230 vs 246, 2,048 rows
    431 vs 490; docs/performance.md, 2026-12-05)."""

    def __init__(self, groups: tuple[Tensor, ...], bias: Tensor | None) -> None:
        super().__init__(None, groups, bias, EVERY_ROW_COUNT, vector_rows=0)

    def tile_kernel(self, x: Tensor) -> Tensor:
        return torch.ops.kvpool.q4_vnni_linear_amx(x, *self.groups)

    def warm_up(self, max_rows: int) -> None:
        """Nothing to build: the groups' kernel takes any row count."""


class Q8Linear(Q4Linear):
    """The same over Q8_0 groups (the LM head)."""

    def kernel(self, x: Tensor) -> Tensor:
        return torch.ops.kvpool.q8_linear(x, *self.groups)

    def tile_kernel(self, x: Tensor) -> Tensor:
        return torch.ops.kvpool.q8_linear_amx(x, *self.groups)


class Q8TileLinear(Q8Linear):
    """Q8_0 groups repacked in the AMX B tiles' order (`models/quantized.q8_vnni_repack`), as
    `Q4TileLinear` does Q4_1 ones: the dense `TileLinear`'s bits from 1 byte a weight."""

    def __init__(self, dense: nn.Module, groups: tuple[Tensor, ...], bias: Tensor | None, max_rows: int) -> None:
        super().__init__(dense, groups, bias, max_rows, vector_rows=0)

    def tile_kernel(self, x: Tensor) -> Tensor:
        return torch.ops.kvpool.q8_vnni_linear_amx(x, *self.groups)
