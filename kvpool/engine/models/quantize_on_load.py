"""Weight-only quantization of an HF checkpoint on load (`--quantization int8 | q4`).

Each projection becomes per-group weights of 32 along K, in the layouts the 4-bit and 8-bit
kernels read (quantized.py): q4 is Q4_1 (a float32 scale and min per group, levels 0..15), int8
is Q8_0 (a float32 scale per group, levels -127..127); the LM head takes Q8_0 in both, as a
GGUF file's usually is. The dense copy that serves larger batches is overwritten with the
groups' values, so every batch size computes with the same weights, as for a GGUF file.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from kvpool.engine.models.quantized import GROUP

logger = logging.getLogger(__name__)

# The groups kept beside the dense weights, in bytes per weight: levels, then float32 scale (+ min)
GROUP_BYTES_PER_WEIGHT = {"q4": 0.5 + 8 / GROUP, "int8": 1 + 4 / GROUP}


def q4_quantize(weight: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
    """((nibbles [N, K/2] uint8, scale [N, K/32], mins [N, K/32]), the float32 weights they
    give): min-max levels 0..15 per group; byte j of a group holds q[j] and q[j + 16] (GGUF's order).
    The values are `q * scale + min`, multiply then add, as the kernels compute them."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(-1, GROUP)
    low = groups.amin(-1, keepdim=True)
    scale = groups.amax(-1, keepdim=True).sub_(low).div_(15)
    q = groups.sub(low).div_(torch.where(scale > 0, scale, 1)).round_().clamp_(0, 15)
    values = groups.copy_(q).mul_(scale).add_(low).reshape(n, k)
    q = q.to(torch.uint8)
    nibbles = (q[:, :16] | (q[:, 16:] << 4)).reshape(n, k // 2)
    return (nibbles, scale.reshape(n, k // GROUP), low.reshape(n, k // GROUP)), values


def q8_quantize(weight: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """((levels [N, K] int8, scale [N, K/32]), the float32 weights they give): each group's
    largest magnitude maps to 127."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(-1, GROUP)
    scale = groups.abs().amax(-1, keepdim=True).div_(127)
    q = groups.div(torch.where(scale > 0, scale, 1)).round_().clamp_(-127, 127)
    values = groups.copy_(q).mul_(scale).reshape(n, k)
    return (q.to(torch.int8).reshape(n, k), scale.reshape(n, k // GROUP)), values


CHUNK = 1 << 18  # weights quantized at a time: the float32 temporaries stay small


def quantize_weight(weight: Tensor, kind: str) -> tuple[Tensor, ...]:
    """`weight`'s groups (q4 or int8), CHUNK weights at a time, the weight overwritten in place
    with their values. A whole 1.7B model's float32 temporaries at once took ~140 s here, most
    of it first touches of freshly mapped memory; chunks keep the peak at the weights + 1 MiB."""
    n, k = weight.shape
    project = q4_quantize if kind == "q4" else q8_quantize
    rows = max(1, CHUNK // k)
    parts: list[tuple[Tensor, ...]] = []
    for start in range(0, n, rows):
        block = weight[start : start + rows]
        groups, values = project(block)
        block.copy_(values)
        parts.append(groups)
    return tuple(torch.cat(p).contiguous() for p in zip(*parts, strict=True))


def quantize_model(model: nn.Module, kind: str) -> dict[str, tuple[Tensor, ...]]:
    """Groups of every projection (`kind`) and of the LM head (Q8_0), by the names
    `pack_cpu_weights` looks them up under; each weight is replaced by its groups' values."""
    found: dict[str, tuple[Tensor, ...]] = {}
    skipped = []
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for part, owner in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
                for proj in owner.PROJECTIONS:
                    weight = getattr(owner, proj).weight
                    name = f"layers.{i}.{part}.{proj}"
                    if weight.shape[1] % GROUP:
                        skipped.append(name)
                        continue
                    found[name] = quantize_weight(weight, kind)
        head_name = "embed_tokens.weight" if model.lm_head is None else "lm_head"
        head = model.get_parameter(head_name)
        if head.shape[1] % GROUP == 0:
            found[head_name] = quantize_weight(head, "int8")
        else:
            skipped.append(head_name)
    if skipped:
        logger.info("%d weights stay dense: K is not a multiple of %d (%s, ...)", len(skipped), GROUP, skipped[0])
    logger.info("quantized %d weights on load: projections %s, LM head int8 (groups of %d)",
                len(found), kind, GROUP)
    return found
