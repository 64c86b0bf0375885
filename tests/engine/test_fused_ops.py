"""Fused per-layer ops (bf16 steps; the norms and RoPE + K/V write in float32 too): each equals the torch ops it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpool.engine.attention import write_kv
from kvpool.engine.kernels import fused_ops_available
from kvpool.engine.layers import fused_ops as fused
from kvpool.engine.layers.norm import RMSNorm
from kvpool.engine.layers.rotary import apply_rotary

needs_kernel = pytest.mark.skipif(not fused_ops_available(), reason="no C++ compiler for the fused ops")
BF16 = torch.bfloat16


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in bf16 steps (same-sign values)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


def torch_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * xf.to(x.dtype)


@needs_kernel
def test_norm_and_residual_add_match_torch_to_one_bf16_step():
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=gen) + 0.5)
    x = (torch.randn(13, 576, generator=gen) * 3).to(BF16)
    res = torch.randn(13, 576, generator=gen).to(BF16)
    assert ulps(fused.rms_norm(x, norm.weight, norm.eps), torch_norm(x, norm)) <= 1  # mean's summation order
    h, total = fused.add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(total, x + res)
    assert ulps(h, torch_norm(x + res, norm)) <= 1


@needs_kernel
def test_silu_mul_matches_torch_to_one_bf16_step():
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(9, 2 * 1544, generator=gen) * 4).to(BF16)  # 1544: a 16-lane tail of 8
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = fused.silu_mul(gate_up)
    assert out.shape == ref.shape
    assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=1e-30)


@needs_kernel
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,t", [(9, 3, 7), (4, 4, 7), (9, 3, 150)])
def test_rope_and_kv_write_equal_torch_bit_for_bit(heads, kv_heads, t, dtype):
    gen = torch.Generator().manual_seed(2)
    d, blocks, bs = 64, 40, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    angles = torch.rand(t, 1, d // 2, generator=gen) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:t]
    caches = [torch.zeros(blocks, bs, kv_heads, d, dtype=dtype) for _ in range(4)]
    q, k = fused.rope_write_kv(qkv, cos, sin, caches[0], caches[1], slots, heads, kv_heads)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d), cos, sin)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    write_kv(qk[:, heads:], v, caches[2], caches[3], slots)
    assert torch.equal(q, qk[:, :heads]) and torch.equal(k, qk[:, heads:])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="out of the cache"):
        fused.rope_write_kv(qkv, cos, sin, caches[0], caches[1], slots + blocks * bs, heads, kv_heads)


def test_float32_and_bf16_steps_take_the_fused_ops():
    assert fused.usable(torch.zeros(4, 8)) == fused_ops_available()
    assert fused.usable(torch.zeros(4096, 8, dtype=BF16)) == fused_ops_available()
    assert not fused.usable(torch.zeros(4, 8, dtype=torch.float16))


@needs_kernel
@pytest.mark.parametrize("rows", [13, 700])  # one running sum; 16 lanes (prefill-sized steps)
def test_float32_norm_and_residual_add_match_torch_but_for_summation_order(rows):
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(584, 1e-5)  # 584: a 16-lane tail of 8
    with torch.no_grad():
        norm.weight.copy_(torch.rand(584, generator=gen) + 0.5)
    x, res = torch.randn(rows, 584, generator=gen) * 3, torch.randn(rows, 584, generator=gen)
    # a few ulps: the squares are summed in another order
    ref = lambda v: F.rms_norm(v, (584,), norm.weight, norm.eps)  # noqa: E731 - torch's norm
    assert torch.allclose(fused.rms_norm(x, norm.weight, norm.eps), ref(x), rtol=2e-6, atol=0)
    h, total = fused.add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(total, x + res)
    assert torch.allclose(h, ref(x + res), rtol=2e-6, atol=0)
    with pytest.raises(RuntimeError, match="weight"):
        fused.rms_norm(x, norm.weight.to(BF16), norm.eps)


@needs_kernel
@pytest.mark.parametrize("rows", [9, 300])
def test_float32_silu_mul_matches_torch_to_a_few_ulps(rows):
    gen = torch.Generator().manual_seed(6)
    gate_up = torch.randn(rows, 2 * 1540, generator=gen) * 4  # 1540: an 8- and a 16-lane tail of 4
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert torch.allclose(fused.silu_mul(gate_up), ref, rtol=1e-6, atol=1e-30)


@needs_kernel
def test_prefill_sized_rows_match_torch_ops():
    """Rows past one thread's share (prefill steps split them over threads) and a 16-lane tail."""
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(584, 1e-5).to(BF16)
    x = (torch.randn(700, 584, generator=gen) * 3).to(BF16)
    res = torch.randn(700, 584, generator=gen).to(BF16)
    h, total = fused.add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(total, x + res) and ulps(h, torch_norm(x + res, norm)) <= 1
    gate_up = torch.randn(300, 2 * 1544, generator=gen).to(BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(fused.silu_mul(gate_up).float(), (F.silu(gate) * up).float(), rtol=2**-7, atol=1e-30)


@needs_kernel
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows", [5, 90])
def test_residual_carried_into_the_next_norm_equals_separate_adds(rows, dtype):
    """The residual add carried into the next layer's norm (one fused op) changes no bit of the
    hidden states against adding first and norming the sum (decode-sized and prefill-sized
    steps, one sequence of `rows` new tokens); in float32 the norms' summation order changes the
    last bits only."""
    from kvpool.engine.attention import AttentionMetadata
    from kvpool.engine.models.config import ModelConfig
    from kvpool.engine.models.llama import LlamaForCausal, allocate_kv_caches

    torch.manual_seed(4)
    config = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=32)
    model = LlamaForCausal(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model = model.to(dtype)
    ids = torch.randint(0, 64, (rows,))
    meta = AttentionMetadata.build([rows], [rows], [list(range(-(-rows // 16)))], 16)
    outs = []
    for carried in (True, False):
        caches = allocate_kv_caches(config, 8, 16, dtype, "cpu")
        outs.append((model(ids, meta.positions, caches, meta) if carried else
                     _separate_adds(model, ids, caches, meta), caches))
    (a, ca), (b, cb) = outs
    same = torch.equal if dtype == BF16 else lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-5)
    assert same(a, b)
    assert all(same(x, y) for pa, pb in zip(ca, cb, strict=True) for x, y in zip(pa, pb, strict=True))


@torch.inference_mode()
def _separate_adds(model, ids: torch.Tensor, caches: list, meta) -> torch.Tensor:
    """The model's layers with each residual add on its own, before the norm that reads it."""
    x = model.embed_tokens(ids)
    cos, sin = model.rotary(meta.positions, x.dtype)
    for layer, cache in zip(model.layers, caches, strict=True):
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, cache, meta)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


def _centered_q4_1(n: int, k: int, seed: int) -> torch.Tensor:
    """Exact Q4_1 weights (float16 scale and min per 32) centred on zero, so that each token's
    hidden state, and each window's attention, shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    scale = (torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    return (q * scale + (-7.5 * scale).half().float()).reshape(n, k)


def _q4_model(dtype: torch.dtype, windows: tuple):
    """A 3-layer Llama whose projections are exact Q4_1 weights, packed onto the 4-bit kernels."""
    from kvpool.engine.kernels import q4_lanes_available
    from kvpool.engine.models.config import ModelConfig
    from kvpool.engine.models.llama import LlamaForCausal
    from kvpool.engine.models.quantized import model_groups

    torch.manual_seed(5)
    config = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=32, layer_windows=windows)
    model = LlamaForCausal(config)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if "embed" in name:
                p.normal_(0, 1)
            else:
                p.copy_(_centered_q4_1(*p.shape, seed=i) if p.dim() == 2 else p.normal_(1, 0.2))
    model.quant_groups = model_groups(model, "embed_tokens.weight")  # as the loader finds a GGUF file's
    model = model.to(dtype)
    with pytest.MonkeyPatch.context() as patch:
        if not q4_lanes_available(float32=dtype == torch.float32):  # no invariant 4-bit kernel for this dtype here
            from kvpool.engine.layers import packing

            patch.setattr(packing, "batch_invariant", lambda: False)
        model.pack_cpu_weights(q4_kernels=True)
    return model


@needs_kernel
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("windows", [(), (None, 8, None)], ids=["full", "window"])
def test_native_decode_loop_equals_the_python_layer_loop_bit_for_bit(dtype, windows):
    """A decode-sized step (two decode rows, a short chunk over a cached prefix) through the
    native layer loop gives the Python loop's hidden states and KV writes exactly."""
    from kvpool.engine.attention import AttentionMetadata
    from kvpool.engine.kernels import decode_loop_available
    from kvpool.engine.models.llama import allocate_kv_caches

    if not decode_loop_available():
        pytest.skip("the native decode loop could not be built (see the log)")
    model = _q4_model(dtype, windows)
    loop = model.decode_loop
    assert loop is not None
    qlens, slens = [1, 5, 1], [20, 16, 37]
    tables = [[0, 1], [2, 3], [4, 5, 6]]
    meta = AttentionMetadata.build(qlens, slens, tables, 16)
    ids = torch.randint(0, 64, (sum(qlens),))
    gen = torch.Generator().manual_seed(1)
    start = [(k.normal_(generator=gen), v.normal_(generator=gen))
             for k, v in allocate_kv_caches(model.config, 8, 16, dtype, "cpu")]
    outs = []
    for native in (True, False):
        model.decode_loop = loop if native else None
        caches = [(k.clone(), v.clone()) for k, v in start]
        if native:
            x = model.embed_tokens(ids)
            assert loop.takes(x, caches, meta)
        outs.append((model(ids, meta.positions, caches, meta), caches))
    (a, ca), (b, cb) = outs
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for pa, pb in zip(ca, cb, strict=True) for x, y in zip(pa, pb, strict=True))


@needs_kernel
def test_native_decode_loop_leaves_larger_steps_to_the_python_loop():
    """Rows past the 4-bit kernels' limit (dense projections) do not take the native loop."""
    from kvpool.engine.attention import AttentionMetadata

    model = _q4_model(torch.float32, ())
    loop = model.decode_loop
    if loop is None:
        pytest.skip("the native decode loop could not be built (see the log)")
    rows = loop.limits.max_rows + 1
    meta = AttentionMetadata.build([rows], [rows], [list(range(-(-rows // 16)))], 16)
    from kvpool.engine.models.llama import allocate_kv_caches

    caches = allocate_kv_caches(model.config, 8, 16, torch.float32, "cpu")
    assert not loop.takes(torch.zeros(rows, 128), caches, meta)
    assert loop.takes(torch.zeros(loop.limits.max_rows, 128), caches, AttentionMetadata.build(
        [loop.limits.max_rows], [loop.limits.max_rows], [list(range(-(-loop.limits.max_rows // 16)))], 16))
