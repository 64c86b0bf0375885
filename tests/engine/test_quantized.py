"""4-bit projections: recovered bit for bit from the float weights, and the same model."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.kernels import q4_linear_available
from kvpool.engine.models.quantized import MAX_ROWS, Q4Linear, q4_groups

needs_kernel = pytest.mark.skipif(not q4_linear_available(), reason="no C++ compiler for the 4-bit kernel")


def q4_1_weight(n: int, k: int, seed: int = 0, top: int = 15) -> torch.Tensor:
    """A float weight made the way GGUF's Q4_1 dequantizes: float16 scale and min per 32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, top + 1, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, top  # the quantizer maps each group's min to 0 and max to 15
    scale = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).half().float()
    low = (-torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    return (q * scale + low).reshape(n, k)


def test_groups_are_recovered_only_from_exact_4bit_weights():
    w = q4_1_weight(40, 96)
    nibbles, scale, mins = q4_groups(w)
    assert nibbles.shape == (40, 48) and nibbles.dtype == torch.uint8 and scale.shape == mins.shape == (40, 3)
    assert q4_groups(torch.randn(40, 96)) is None  # arbitrary floats are not 4-bit groups
    assert q4_groups(w[:, :90].contiguous()) is None  # K not a multiple of the group
    constant = torch.full((8, 32), 0.25)
    assert q4_groups(constant) is not None  # a group of equal weights is scale 0, min w
    for top in (15, 11):  # 11: groups whose max is not level 15 (the slower, sorting path)
        weight = q4_1_weight(16, 64, seed=top, top=top)
        nibbles, scale, mins = q4_groups(weight)
        per_group = nibbles.reshape(16, 2, 16)  # byte j: level j low, level j + 16 high
        levels = torch.cat((per_group & 15, per_group >> 4), dim=-1).float()
        assert torch.equal(levels * scale[..., None] + mins[..., None], weight.reshape(16, 2, 32))


@needs_kernel
def test_kernel_reproduces_every_weight_exactly_and_matches_a_dense_matmul():
    w = q4_1_weight(72, 64, seed=1)
    groups = q4_groups(w)
    eye = torch.eye(64)
    for start in range(0, 64, 13):  # 13 rows: one pass of 8 rows, then a pass of 5
        rows = eye[start : start + 13]
        # one-hot rows pick single weights: any error in the dequantization would show
        assert torch.equal(torch.ops.kvpool.q4_linear(rows, *groups), rows @ w.T)
    for rows in (1, 3, 8, 9, 16):
        x = torch.randn(rows, 64)
        assert torch.allclose(torch.ops.kvpool.q4_linear(x, *groups), x @ w.T, atol=1e-5)


@needs_kernel
def test_q4_linear_serves_small_batches_from_4bits_and_large_ones_dense():
    w = q4_1_weight(48, 64, seed=2)
    bias = torch.randn(48)
    calls = []

    def dense(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x @ w.T + bias

    lin = Q4Linear(dense, q4_groups(w), bias)
    for rows in (1, MAX_ROWS, MAX_ROWS + 1, 100):
        x = torch.randn(rows, 64)
        assert torch.allclose(lin(x), x @ w.T + bias, atol=1e-5)
    assert calls == [MAX_ROWS + 1, 100]


@needs_kernel
def test_decode_steps_on_4bit_projections_match_the_float_model(plain_loaded):
    """Every projection of the bundled Q4_1 model is served from 4 bits, and single-token
    decode steps give the float model's logits (to summation order) and tokens."""
    from test_model_reference import PROMPTS, PagedSequence

    from kvpool.engine.loader import load_model

    q4 = load_model(None)
    q4.model.pack_cpu_weights(q4_kernels=True)
    layer = q4.model.layers[0]
    assert all(isinstance(m, Q4Linear) for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
    for prompt in PROMPTS[:4]:
        ids = plain_loaded.tokenizer.encode(prompt)
        ref, ours = PagedSequence(plain_loaded), PagedSequence(q4)
        a, b = ref.step(ids)[-1:], ours.step(ids)[-1:]
        for _ in range(12):
            token = int(a.argmax())
            assert int(b.argmax()) == token
            a, b = ref.step([token]), ours.step([token])
            assert (a - b).abs().max().item() <= 1e-3
