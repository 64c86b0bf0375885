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
    give): min-max levels 0..15 per group; byte j of a group holds q[j] and q[j + 16] (GGUF's order)."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(-1, GROUP)
    low = groups.amin(-1)
    scale = (groups.amax(-1) - low) / 15
    q = torch.where(scale[:, None] > 0, (groups - low[:, None]) / scale[:, None], 0).round().clamp(0, 15)
    values = (q * scale[:, None] + low[:, None]).reshape(n, k)
    q = q.to(torch.uint8)
    nibbles = (q[:, :16] | (q[:, 16:] << 4)).reshape(n, k // 2).contiguous()
    return (nibbles, scale.reshape(n, k // GROUP).contiguous(), low.reshape(n, k // GROUP).contiguous()), values


def q8_quantize(weight: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """((levels [N, K] int8, scale [N, K/32]), the float32 weights they give): each group's
    largest magnitude maps to 127."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(-1, GROUP)
    scale = groups.abs().amax(-1) / 127
    q = torch.where(scale[:, None] > 0, groups / scale[:, None], 0).round().clamp(-127, 127)
    values = (q * scale[:, None]).reshape(n, k)
    return (q.to(torch.int8).reshape(n, k).contiguous(), scale.reshape(n, k // GROUP).contiguous()), values


def quantize_model(model: nn.Module, kind: str) -> dict[str, tuple[Tensor, ...]]:
    """Groups of every projection (`kind`) and of the LM head (Q8_0), by the names
    `pack_cpu_weights` looks them up under; each weight is replaced by its groups' values."""
    project = q4_quantize if kind == "q4" else q8_quantize
    found: dict[str, tuple[Tensor, ...]] = {}
    skipped = []
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for part, owner in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
                for proj in ("qkv_proj", "o_proj") if part == "self_attn" else ("gate_up_proj", "down_proj"):
                    weight = getattr(owner, proj).weight
                    name = f"layers.{i}.{part}.{proj}"
                    if weight.shape[1] % GROUP:
                        skipped.append(name)
                        continue
                    found[name], values = project(weight)
                    weight.copy_(values)
        head_name = "embed_tokens.weight" if model.lm_head is None else "lm_head"
        head = model.get_parameter(head_name)
        if head.shape[1] % GROUP == 0:
            found[head_name], values = q8_quantize(head)
            head.copy_(values)
        else:
            skipped.append(head_name)
    if skipped:
        logger.info("%d weights stay dense: K is not a multiple of %d (%s, ...)", len(skipped), GROUP, skipped[0])
    logger.info("quantized %d weights on load: projections %s, LM head int8 (groups of %d)",
                len(found), kind, GROUP)
    return found
