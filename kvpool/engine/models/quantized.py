"""Quantized weights for decode-sized batches: the bundled GGUF stores every projection as Q4_1
groups and the (tied) embedding as Q8_0 groups, and a decode step streams the weights once per
token batch, so reading the groups instead of their float copy cuts the bytes per step 2-6x.

The groups are recovered from the float32 weights and checked bit for bit: a matrix is served
from its groups only when `d * q + m` (Q4_1) or `d * q` (Q8_0), in float32 as the checkpoint's
float copy was made, reproduces every weight exactly. Under bfloat16 the kernel rounds each
such weight to bfloat16 as the dense bf16 copy was rounded, so in either dtype results change
by summation order alone. A bf16 model has no float32 weights left to check, so the loader
recovers the groups before it casts (`model_groups`). The layers that serve them are
`engine/layers/linear.py`'s `Q4Linear` and `Q8Linear`; this module finds and checks the groups
and the row limits of their kernels."""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from kvpool.engine.kernels import q4_amx_available, q4_lanes_available

GROUP = 32
# Above these a batch is compute-bound and the dense packed GEMM (AMX under bf16) is faster:
# the vector kernels' dot products cost rows x weights, AMX's a sixteenth. Under bf16 with AMX
# a third kernel dequantizes the groups into AMX tiles: it pays the dequantization once per
# weight whatever the rows, so it takes over from the vector kernel at 4 rows and beats the
# dense copy up to ~32 (cold weights; figures in docs/architecture.md).
# float32 activations: on AVX-512 (16 lanes, a faster oneDNN) the dense GEMM wins above 16
# rows; on AVX2 the 8-lane kernel still beats it at 48 (68 vs 79 ms at 32 rows over the
# bundled model's 120 projections, 103 vs 113 at 48; even at 64).
MAX_ROWS = 48 if torch.backends.cpu.get_cpu_capability() == "AVX2" else 16
HEAD_MAX_ROWS = 16  # the LM head over Q8_0 groups, float32 (AVX2: 8.3 vs 9.9 ms at 16, 16.3 vs 15.3 at 32)
MAX_ROWS_BF16 = 3  # the vector (vdpbf16ps) kernel where the AMX one runs
VECTOR_ONLY_MAX_ROWS_BF16 = 8  # ... and where it does not
HEAD_MAX_ROWS_BF16 = 4  # the LM head over Q8_0 groups
AMX_MAX_ROWS_BF16 = 32  # the AMX kernel, above MAX_ROWS_BF16
# The head's AMX kernel lost to oneDNN at every row count measured (its 56 MB bf16 copy stays
# in this CPU's 300 MB L3): off until a machine shows otherwise.
HEAD_AMX_MAX_ROWS_BF16 = HEAD_MAX_ROWS_BF16
# The batch-invariant lanes kernels (their bits equal the dense GEMM's) serve every row count:
# above 8 rows each thread dequantizes a panel of 64 outputs once and runs every row over it
# (`kernels/q4_nlanes.h` panels), which beat oneDNN's dense GEMM at every size measured (2-core
# AMD EPYC, AVX512-BF16, the bundled model's 120 projections out of cache: 9 rows 12.1 vs 19.4 ms,
# 128 rows 68.6 vs 74.4, 1,024 rows 503 vs 519), so the dense copy is dropped once checked.
# On SmolLM2-1.7B's shapes they are at parity (one layer: 9 rows 7.2 vs 8.7 ms, 16-64 rows 4-6%
# slower, 128-512 rows within 2%), the 8-bit ones slower (9-32 rows 12-18%): those keep 8 rows.
LANES_MAX_ROWS_BF16 = sys.maxsize
LANES_Q8_MAX_ROWS_BF16 = 8
# Batch-invariant with AMX: oneDNN's bf16 GEMM sums K on AMX tiles in one chain up to 32 rows
# (`linear.AgreeingBuckets`), as the AMX tile kernel does at every row count, while the lanes
# kernels' vdpbf16ps adds each K pair in the other order; so the tile kernel serves the groups
# up to 32 rows (30 layers of the bundled model's projections, 2 threads: 9.3 ms at 1 row vs
# oneDNN's 15.8) and the dense copy, on the same kernel (`TileLinear`), larger batches (0.29 vs
# 0.45 ms a layer at 64 rows, 1.8 vs 2.2 at 512). The LM head's dense copy is a `TileLinear` too
# (2026-12-05, out of cache in a 32-row decode step: 2.5 ms against oneDNN's 3.5). Its Q8_0
# groups, repacked in the tiles' order (`q8_vnni_repack`), serve steps of up to 32 rows: 28 MB
# read instead of 56 (2 threads, out of cache: 1.96 vs 2.17 ms at 1 row, 2.17 vs 2.62 at 32);
# above, the whole-strip dequantization loses (3.8 vs 3.1 ms at 33 rows).
TILES_MAX_ROWS_BF16 = 32
# ... and Q4_1 groups repacked in the B tiles' order serve every row count (`Q4TileLinear`).
LANES_HEAD_MAX_ROWS_BF16 = 4
# float32 lanes kernels (AVX2 Zen 3, one thread, a shared box): the bundled model's four
# projections of a layer take 0.54-0.70 ms at 1 row (dense 2.3-3.0, the per-row-count kernel
# 0.46-0.54), 1.48 vs dense 2.4-3.0 at 8, 3.3 vs 3.3-4.0 at 16, 6.8-8.9 vs 5.0-5.6 at 32; the Q8_0
# head 2.5-3.3 vs 11.6-15.6 ms at 1 row, 10.5-13.4 vs 12.3-15.7 at 8, 21-23 vs 19-23 at 16.
LANES_MAX_ROWS_F32 = 16
LANES_HEAD_MAX_ROWS_F32 = 8


def row_limits(bf16: bool, head: bool = False, invariant: bool = False, bits: int = 4) -> tuple[int, int]:
    """(rows up to which the vector kernel runs, rows up to which the groups serve at all):
    the AMX kernel takes the rows between, where this CPU and kernel build have it. Batch-
    invariant: the lanes kernels, or on AMX CPUs the AMX kernel alone (see TILES_MAX_ROWS_BF16).
    `bits`: a projection's groups, 4 (Q4_1) or 8 (Q8_0)."""
    if invariant:
        if bf16 and q4_amx_available():
            return 0, TILES_MAX_ROWS_BF16
        if bf16:
            rows = (LANES_HEAD_MAX_ROWS_BF16 if head else LANES_MAX_ROWS_BF16 if bits == 4
                    else LANES_Q8_MAX_ROWS_BF16)
        else:
            rows = LANES_HEAD_MAX_ROWS_F32 if head else LANES_MAX_ROWS_F32
        return rows, rows
    if not bf16:
        return (HEAD_MAX_ROWS, HEAD_MAX_ROWS) if head else (MAX_ROWS, MAX_ROWS)
    if head:
        vector, tiles, alone = HEAD_MAX_ROWS_BF16, HEAD_AMX_MAX_ROWS_BF16, HEAD_MAX_ROWS_BF16
    else:
        vector, tiles, alone = MAX_ROWS_BF16, AMX_MAX_ROWS_BF16, VECTOR_ONLY_MAX_ROWS_BF16
    return (vector, tiles) if tiles > vector and q4_amx_available() else (alone, alone)


def q4_groups(weight: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(nibbles [N, K/2] uint8, scale [N, K/32], mins [N, K/32]) when each run of 32 weights
    along K is exactly scale * q + min with q in 0..15 and scale a float16 value; else None.
    Byte j of a group holds q[j] in its low nibble and q[j + 16] in its high one (GGUF's order)."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % GROUP:
        return None
    groups = weight.detach().reshape(-1, GROUP)
    low = groups.amin(-1)
    span = groups.amax(-1) - low
    # A Q4_1 quantizer maps a group's max to 15; where it did not, the smallest gap between
    # distinct weights is a multiple of the scale.
    scale = (span / 15).half().float()
    q, exact = _levels(groups, low, scale)
    if not bool(exact.all()):
        odd = (~exact).nonzero().squeeze(1)
        steps = groups[odd].sort(-1).values.diff(dim=-1)
        smallest = torch.where(steps > 0, steps, torch.inf).amin(-1)
        levels = (span[odd] / smallest).round().clamp(min=1)
        scale[odd] = (span[odd] / levels).half().float()
        q[odd], exact[odd] = _levels(groups[odd], low[odd], scale[odd])
        if not bool(exact.all()):
            return None
    q = q.to(torch.uint8)
    nibbles = (q[:, :16] | (q[:, 16:] << 4)).reshape(n, k // 2).contiguous()
    return nibbles, scale.reshape(n, k // GROUP).contiguous(), low.reshape(n, k // GROUP).contiguous()


def _levels(groups: Tensor, low: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Each weight's level under (scale, low), and which groups it reproduces bit for bit."""
    q = torch.where(scale[:, None] > 0, (groups - low[:, None]) / scale[:, None], 0).round()
    exact = ((q * scale[:, None] + low[:, None]) == groups).all(-1) & (q >= 0).all(-1) & (q <= 15).all(-1)
    return q, exact


def q8_groups(weight: Tensor) -> tuple[Tensor, Tensor] | None:
    """(levels [N, K] int8, scale [N, K/32]) when each run of 32 weights along K is exactly
    scale * q with q in -127..127 and scale a float16 value (GGUF's Q8_0); else None."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % GROUP:
        return None
    groups = weight.detach().reshape(-1, GROUP)
    # The quantizer maps each group's largest magnitude to +-127: scale * 127 is exact in float32.
    scale = (groups.abs().amax(-1) / 127).half().float()
    q = torch.where(scale[:, None] > 0, groups / scale[:, None], 0).round()
    if not bool(((q * scale[:, None] == groups) & (q.abs() <= 127)).all()):
        return None
    return q.to(torch.int8).reshape(n, k).contiguous(), scale.reshape(n, k // GROUP).contiguous()


def reproduces(weight: Tensor, groups: tuple[Tensor, ...]) -> bool:
    """Whether Q4_1 (nibbles, scale, mins) or Q8_0 (levels, scale) groups give `weight` bit for
    bit, d * q (+ m) in float32 as the kernels compute it: what a cached copy must pass."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % GROUP or groups[1].shape != (n, k // GROUP):
        return False
    if len(groups) == 3:
        nibbles, scale, mins = groups
        if nibbles.shape != (n, k // 2) or mins.shape != scale.shape:
            return False
        packed = nibbles.view(n, k // GROUP, GROUP // 2)
        values = torch.cat((packed & 15, packed >> 4), dim=-1).float() * scale.unsqueeze(-1) + mins.unsqueeze(-1)
    else:
        levels, scale = groups
        if levels.shape != (n, k):
            return False
        values = levels.view(n, k // GROUP, GROUP).float() * scale.unsqueeze(-1)
    return torch.equal(values.view(n, k), weight)


def model_groups(model: nn.Module, head: str) -> dict[str, tuple[Tensor, ...]]:
    """Q4_1 groups of every exactly-4-bit Linear (by module name) and Q8_0 groups of the LM
    head's weight (parameter `head`), from float32 weights, before a cast rounds them."""
    found: dict[str, tuple[Tensor, ...]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (groups := q4_groups(module.weight)) is not None:
            found[name] = groups
    head_groups = q8_groups(model.get_parameter(head))
    if head_groups is not None:
        found[head] = head_groups
    return found


# oneDNN's K block for a shape (all of K, or a block it chose): the lanes kernels keep the one
# that reproduces the dense GEMM bit for bit (None: all of K).
K_BLOCKS = (None, 512, 256, 384, 768, 1024, 1536, 2048, 128, 64)
# Two K blocks differ only where a float32 rounding difference flips the output's bf16 rounding:
# on 1 output in ~10^4-10^5 (measured 2e-5 for all of K against 512 on a 576 x 576 projection),
# so one small probe lets a wrong block through. Each round keeps the blocks that still agree,
# on fresh rows, until one is left (ended early) or the rows run out (`PROBE_ROWS` in all).
PROBE_ROUNDS = (48, 192, 768, 1536)
PROBE_ROWS = sum(PROBE_ROUNDS)
_kblock_by_shape: dict[tuple[int, int, int, bool], int | None] = {}  # proven on the full probe
LANES_SPAN_F32 = 64  # outputs per repacked block of the float32 lanes kernels


def lanes_groups(
    dense: nn.Module, groups: tuple[Tensor, ...], dtype: torch.dtype = torch.bfloat16
) -> tuple[Tensor, ...] | None:
    """`groups` repacked for the lanes kernels (bf16: kernels/q4_nlanes.h, float32:
    q4_lanes_f32.h) in the K block whose results on `dtype` rows equal `dense`'s (the oneDNN
    GEMM) bit for bit, so a projection's bits do not depend on which of the two a step's row
    count picks; None where no block, or more than one, survives the probe (the projection then
    stays dense for every row count). The block is oneDNN's choice for the shape: once one block
    alone survived the rounds, later projections of that shape check it on the first round's rows."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"lanes kernels take bfloat16 or float32 rows, not {dtype}")
    float32 = dtype == torch.float32
    n, k = groups[1].shape[0], groups[1].shape[1] * GROUP
    if not q4_lanes_available(float32) or n % (LANES_SPAN_F32 if float32 else 16):
        return None
    ops = torch.ops.kvpool
    repack, linear = (ops.q4_repack, ops.q4_linear) if len(groups) == 3 else (ops.q8_repack, ops.q8_linear)
    key = (len(groups), n, k, float32)
    proven = key in _kblock_by_shape
    blocks = [_kblock_by_shape[key]] if proven else [b for b in K_BLOCKS if b is None or b < k]  # b >= k: all of K
    packed = {b: tuple(repack(*groups, k if b is None else b, float32)) for b in blocks}
    gen = torch.Generator().manual_seed(n * 7919 + k)
    for rows in PROBE_ROUNDS[:1] if proven else PROBE_ROUNDS:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        want = dense(x)
        blocks = [b for b in blocks if torch.equal(linear(x, *packed[b]), want)]
        if len(blocks) <= 1:
            break
    if len(blocks) != 1:
        return None
    if not proven:
        _kblock_by_shape[key] = blocks[0]
    return packed[blocks[0]]


def tile_groups(dense: nn.Module, groups: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
    """The groups for the AMX tile kernels where their results on bf16 rows equal `dense`'s (the
    batch-invariant oneDNN GEMM or `TileLinear`) bit for bit on probe rows, else None (the
    projection stays dense): Q4_1 groups repacked in the B tiles' order (`q4_vnni_repack`;
    outputs a multiple of 16), Q8_0 groups likewise (`q8_vnni_repack`)."""
    n, k = groups[1].shape[0], groups[1].shape[1] * GROUP
    gen = torch.Generator().manual_seed(n * 7919 + k)
    x = torch.randn(TILES_MAX_ROWS_BF16 + 5, k, generator=gen).bfloat16()  # one pass, and a part-filled one
    if n % 16:
        return None
    if len(groups) == 3:
        groups, kernel = q4_vnni_repack(*groups), torch.ops.kvpool.q4_vnni_linear_amx
    else:
        groups, kernel = q8_vnni_repack(*groups), torch.ops.kvpool.q8_vnni_linear_amx
    return groups if torch.equal(kernel(x, *groups), dense(x)) else None


def q4_vnni_repack(nibbles: Tensor, scale: Tensor, mins: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_1 groups (`q4_groups`) in the order `kvpool::q4_vnni_linear_amx` dequantizes them
    straight into AMX B tiles: nibbles [N/16, K/32, 16 pairs of K, 16 bytes], byte b of pair p
    holding output b/2's weight 2p + b%2 (low nibble) and output 8 + b/2's (high nibble); scales
    and mins [N/16, K/32, 16 outputs]. N must be a multiple of 16."""
    n, groups = scale.shape
    if n % 16:
        raise ValueError(f"q4_vnni_repack: {n} outputs, not a multiple of 16")
    packed = nibbles.view(n, groups, GROUP // 2)
    levels = torch.cat((packed & 15, packed >> 4), dim=-1)  # [N, K/32, 32] in K order
    by_pair = levels.view(n // 16, 2, 8, groups, 16, 2).permute(0, 3, 4, 1, 2, 5)  # strip, group, pair, half, output, k
    vq = (by_pair[:, :, :, 0] | (by_pair[:, :, :, 1] << 4)).reshape(n // 16, groups, 16, 16).contiguous()
    return vq, _per_strip(scale), _per_strip(mins)


def q8_vnni_repack(levels: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Q8_0 groups (`q8_groups`) in the order `kvpool::q8_vnni_linear_amx` dequantizes them
    straight into AMX B tiles: levels [N/16, K/32, 16 pairs of K, 32 bytes], byte 2o + j of
    pair p holding output o's weight 2p + j (the tile row's word order); scales [N/16, K/32,
    16 outputs]. N must be a multiple of 16."""
    n, groups = scale.shape
    if n % 16:
        raise ValueError(f"q8_vnni_repack: {n} outputs, not a multiple of 16")
    by_pair = levels.view(n // 16, 16, groups, 16, 2).permute(0, 2, 3, 1, 4)  # strip, group, pair, output, k
    return by_pair.reshape(n // 16, groups, 16, 32).contiguous(), _per_strip(scale)


def _per_strip(t: Tensor) -> Tensor:
    """[N, K/32] per-group values as [N/16, K/32, 16]: a strip's 16 outputs side by side."""
    n, groups = t.shape
    return t.float().view(n // 16, 16, groups).transpose(1, 2).contiguous()
