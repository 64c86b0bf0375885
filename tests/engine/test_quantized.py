"""4-bit projections: recovered bit for bit from the float weights, and the same model."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.kernels import batch_invariant, q4_amx_available, q4_linear_available
from kvpool.engine.layers.linear import Q4Linear, Q8Linear
from kvpool.engine.models import quantized
from kvpool.engine.models.quantized import (
    MAX_ROWS,
    q4_groups,
    q8_groups,
    row_limits,
)

needs_kernel = pytest.mark.skipif(not q4_linear_available(), reason="no C++ compiler for the 4-bit kernel")
needs_amx = pytest.mark.skipif(not q4_amx_available(), reason="no AMX here (or the kernel has none): see the log")


@pytest.fixture(autouse=True)
def per_row_count_kernels(monkeypatch):
    """These tests cover the per-row-count kernels (KVPOOL_BATCH_INVARIANT=0); the invariant
    path has its own tests (test_batch_invariance.py)."""
    from kvpool.engine.layers import packing

    monkeypatch.setattr(packing, "batch_invariant", lambda: False)


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

    lin = Q4Linear(dense, q4_groups(w), bias, MAX_ROWS)
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
    assert isinstance(q4.model.head, Q8Linear)  # the tied head from its Q8_0 groups
    for prompt in PROMPTS[:4]:
        ids = plain_loaded.tokenizer.encode(prompt)
        ref, ours = PagedSequence(plain_loaded), PagedSequence(q4)
        a, b = ref.step(ids)[-1:], ours.step(ids)[-1:]
        for _ in range(12):
            token = int(a.argmax())
            assert int(b.argmax()) == token
            a, b = ref.step([token]), ours.step([token])
            assert (a - b).abs().max().item() <= 1e-3


def q8_0_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A float weight made the way GGUF's Q8_0 dequantizes: a float16 scale per 32 weights."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q[..., 0] = 127  # the quantizer maps each group's largest magnitude to +-127
    scale = (torch.rand(n, k // 32, 1, generator=gen) * 0.01).half().float()
    return (q * scale).reshape(n, k)


def test_8bit_groups_are_recovered_only_from_exact_8bit_weights():
    w = q8_0_weight(24, 64)
    levels, scale = q8_groups(w)
    assert levels.dtype == torch.int8 and scale.shape == (24, 2)
    assert torch.equal(levels.reshape(24, 2, 32).float() * scale[..., None], w.reshape(24, 2, 32))
    assert q8_groups(torch.randn(24, 64)) is None
    assert q8_groups(w.bfloat16()) is None  # rounded weights: nothing to check them against


def _kernel(kind: str, x: torch.Tensor, groups: tuple, tiles: bool = False) -> torch.Tensor:
    ops = torch.ops.kvpool
    if tiles:
        return (ops.q4_linear_amx if kind == "q4" else ops.q8_linear_amx)(x, *groups)
    return (ops.q4_linear if kind == "q4" else ops.q8_linear)(x, *groups)


KERNELS = [pytest.param(False, id="vector"), pytest.param(True, id="amx", marks=needs_amx)]


@needs_kernel
@pytest.mark.parametrize("tiles", KERNELS)
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_bf16_kernel_multiplies_by_the_dense_bf16_copys_weights_bit_for_bit(kind, tiles):
    """One-hot rows pick single weights: the kernel's bf16 weight must be exactly the dense bf16
    copy's (float32 weight rounded to nearest even), and its sums agree with a float32 matmul
    over that copy to one bf16 rounding of the output. 88 outputs: a partial block of 16 (the
    AMX kernel's tile rows); row counts on both sides of each 16 and of its 64-row pass."""
    w = q4_1_weight(88, 96, seed=3) if kind == "q4" else q8_0_weight(88, 96, seed=3)
    groups = q4_groups(w) if kind == "q4" else q8_groups(w)
    dense = w.bfloat16()
    eye = torch.eye(96, dtype=torch.bfloat16)
    for start in range(0, 96, 19):  # 19 rows: a chunk of 16, then 3
        rows = eye[start : start + 19]
        out = _kernel(kind, rows, groups, tiles)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, dense.T[start : start + 19])
    assert torch.equal(_kernel(kind, eye, groups, tiles), dense.T)  # 96 rows: a 64-row pass, then 32
    for n_rows in (1, 2, 5, 8, 16, 17, 33, 64, 65, 100, 130):
        x = torch.randn(n_rows, 96).bfloat16()
        ref = x.float() @ dense.float().T
        out = _kernel(kind, x, groups, tiles).float()
        # float32 sums in another order, then one rounding to bf16 (relative 2^-8)
        assert torch.allclose(out, ref, rtol=2**-8, atol=1e-3), (out - ref).abs().max()


@needs_amx
def test_amx_kernel_over_a_projections_shape_matches_the_vector_kernel():
    """SmolLM2's down projection (K = 1536, 48 groups a row): the tiles' float32 sums and the
    vector kernel's differ by summation order only."""
    w = q4_1_weight(576, 1536, seed=5)
    groups = q4_groups(w)
    x = torch.randn(40, 1536).bfloat16()
    ref = x.float() @ w.bfloat16().float().T
    for out in (_kernel("q4", x, groups, tiles=True), _kernel("q4", x, groups)):
        assert torch.allclose(out.float(), ref, rtol=2**-8, atol=2e-3)


@needs_kernel
def test_amx_kernels_refuse_float32_activations():
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kvpool.q4_linear_amx(torch.randn(2, 64), *q4_groups(q4_1_weight(16, 64)))
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kvpool.q8_linear_amx(torch.randn(2, 64), *q8_groups(q8_0_weight(16, 64)))


@needs_kernel
def test_bf16_batches_run_the_vector_kernel_then_amx_tiles_then_dense():
    w = q4_1_weight(48, 64, seed=4)
    dense_w = w.bfloat16()
    calls: list[tuple[str, int]] = []

    def dense(x: torch.Tensor) -> torch.Tensor:
        calls.append(("dense", x.shape[0]))
        return x @ dense_w.T

    lin = Q4Linear(dense, q4_groups(w), None, max_rows=32, vector_rows=8)
    for name in ("kernel", "tile_kernel"):
        real = getattr(lin, name)
        setattr(lin, name, lambda x, real=real, name=name: calls.append((name, x.shape[0])) or real(x))
    rows = (1, 8, 9, 32, 33) if q4_amx_available() else (1, 8)
    for n in rows:
        x = torch.randn(n, 64).bfloat16()
        ref = x.float() @ dense_w.float().T
        assert torch.allclose(lin(x).float(), ref, rtol=2**-7, atol=1e-2)
    expected = [("kernel", 1), ("kernel", 8), ("tile_kernel", 9), ("tile_kernel", 32), ("dense", 33)]
    assert calls == expected[: len(rows)]


def test_row_limits_give_amx_the_mid_rows_only_where_it_runs(monkeypatch):
    monkeypatch.setattr(quantized, "q4_amx_available", lambda: True)
    assert row_limits(True) == (quantized.MAX_ROWS_BF16, quantized.AMX_MAX_ROWS_BF16)
    assert row_limits(False) == (MAX_ROWS, MAX_ROWS)  # float32: the vector kernel only
    head_vector, head_max = row_limits(True, head=True)
    assert head_vector == quantized.HEAD_MAX_ROWS_BF16 and head_max >= head_vector
    monkeypatch.setattr(quantized, "q4_amx_available", lambda: False)
    assert row_limits(True) == (quantized.VECTOR_ONLY_MAX_ROWS_BF16,) * 2
    assert row_limits(True, head=True) == (quantized.HEAD_MAX_ROWS_BF16,) * 2


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_q8_kernel_on_float32_rows_multiplies_by_the_exact_weights(rows):
    """float32 rows over Q8_0 groups: the float copy's own weights, summation order aside
    (row counts across the kernel's 8-row chunks)."""
    w = q8_0_weight(48, 96, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    got = torch.ops.kvpool.q8_linear(x, *q8_groups(w))
    ref = (x.double() @ w.double().T).float()
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.kvpool.q8_linear(x.half(), *q8_groups(w))


@pytest.fixture(scope="module")
def bf16_q4():
    from kvpool.engine.layers import packing
    from kvpool.engine.loader import load_model

    loaded = load_model(None, dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch:  # built before the per-test patch: the same kernels
        patch.setattr(packing, "batch_invariant", lambda: False)
        loaded.model.pack_cpu_weights(q4_kernels=True)
    return loaded


def _force_dense(model, on: bool) -> None:
    """Route every batch to the dense bf16 copies (the reference) or back to the kernels."""
    for module in model.modules():
        if isinstance(module, Q4Linear):
            module.vector_rows, module.max_rows = (0, 0) if on else row_limits(
                True, isinstance(module, Q8Linear), invariant=batch_invariant())
    model.q4_rows = 0 if on else row_limits(True, invariant=batch_invariant())[1]


@needs_kernel
def test_bf16_model_serves_decode_from_4bit_projections_and_an_8bit_head(bf16_q4):
    """Under bf16 every projection keeps its 4-bit groups and the tied head its Q8_0 groups;
    decode steps on them give the dense bf16 model's logits to bf16 summation order, and its
    greedy tokens (teacher-forced on the dense model's choices)."""
    from test_model_reference import BLOCK_SIZE, PROMPTS, PagedSequence

    from kvpool.engine.models.llama import allocate_kv_caches

    model = bf16_q4.model
    layer = model.layers[0]
    assert all(isinstance(m, Q4Linear) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert isinstance(model.head, Q8Linear)
    agree = total = 0
    worst = 0.0
    for prompt in PROMPTS[:3]:
        ids = bf16_q4.tokenizer.encode(prompt)
        seqs = [PagedSequence(bf16_q4), PagedSequence(bf16_q4)]
        for s in seqs:
            s.kv = allocate_kv_caches(bf16_q4.config, 64, BLOCK_SIZE, torch.bfloat16, "cpu")
        _force_dense(model, True)
        ref = seqs[0].step(ids)[-1:]
        _force_dense(model, False)
        ours = seqs[1].step(ids)[-1:]
        for _ in range(10):
            token = int(ref.argmax())
            agree += int(ours.argmax()) == token
            total += 1
            _force_dense(model, True)
            ref = seqs[0].step([token])
            _force_dense(model, False)
            ours = seqs[1].step([token])
            worst = max(worst, (ref - ours).abs().max().item())
    assert agree >= total - 1, f"{agree}/{total} greedy tokens agree"
    # Logits ~10-20 (bf16 ulp 0.06-0.125); each side's KV cache is its own path's, so 10 steps 30
    # layers deep accumulate rounding: 0.66 seen with the first native kernel, 0.75 with the
    # fused ops, 1.19 with the AVX-512 kernel's summation order (greedy agreement unchanged).
    assert worst <= 1.5, worst


@needs_amx
def test_bf16_model_prefill_chunk_on_amx_tiles_matches_the_dense_model(bf16_q4):
    """A 24-token step runs every projection on the AMX kernel (above the vector kernel's rows):
    its logits are the dense bf16 model's to bf16 summation order, and so are its argmaxes."""
    from test_model_reference import BLOCK_SIZE, PROMPTS, PagedSequence

    from kvpool.engine.models.llama import allocate_kv_caches

    vector_rows, max_rows = row_limits(True)
    ids = [t for p in PROMPTS[:4] for t in bf16_q4.tokenizer.encode(p)][: min(24, max_rows)]
    assert vector_rows < len(ids) <= max_rows
    logits = []
    for dense in (True, False):
        seq = PagedSequence(bf16_q4)
        seq.kv = allocate_kv_caches(bf16_q4.config, 64, BLOCK_SIZE, torch.bfloat16, "cpu")
        _force_dense(bf16_q4.model, dense)
        logits.append(seq.step(ids))
    _force_dense(bf16_q4.model, False)
    ref, ours = logits
    assert (ref - ours).abs().max().item() <= 1.0
    assert (ref.argmax(-1) == ours.argmax(-1)).sum().item() >= len(ids) - 1


def test_a_gguf_models_groups_are_recovered_once_then_read_from_its_cache(tmp_path, monkeypatch):
    """The loader recovers a GGUF model's exact groups once (seconds on the bundled model) and
    caches them beside its dequantized weights; a later load reads the same groups back."""
    from kvpool.engine import loader
    from kvpool.engine.models.config import ModelConfig
    from kvpool.engine.models.llama import LlamaForCausal

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=32)
    model = LlamaForCausal(config)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            p.copy_(q8_0_weight(*p.shape, seed=i) if name in ("embed_tokens.weight", "lm_head") else
                    q4_1_weight(*p.shape, seed=i) if p.dim() == 2 else torch.ones_like(p))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    loader.gguf_cache_dir(path).mkdir(parents=True)
    first = loader._quant_groups(model, path)
    head = "embed_tokens.weight" if config.tie_word_embeddings else "lm_head"
    assert len(first) == 4 * config.num_layers + 1 and len(first[head]) == 2
    assert len(list(loader.gguf_cache_dir(path).glob("groups-*.safetensors"))) == 1
    monkeypatch.setattr(quantized, "model_groups", lambda *a: pytest.fail("recovered again"))
    second = loader._quant_groups(model, path)
    assert first.keys() == second.keys()
    assert all(torch.equal(a, b) for name in first for a, b in zip(first[name], second[name], strict=True))


def test_cached_groups_that_do_not_give_the_weights_are_recovered_again(tmp_path, monkeypatch):
    """A cache written for other weights (a loader change that reorders rows, say) is never
    served: the groups are checked against the loaded weights and recovered afresh."""
    from kvpool.engine import loader
    from kvpool.engine.models.config import ModelConfig
    from kvpool.engine.models.llama import LlamaForCausal

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))
    model = LlamaForCausal(ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                                       num_heads=2, num_kv_heads=1, head_dim=32, tie_word_embeddings=True))
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            p.copy_(q8_0_weight(*p.shape, seed=i) if "embed" in name else
                    q4_1_weight(*p.shape, seed=i) if p.dim() == 2 else torch.ones_like(p))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    loader.gguf_cache_dir(path).mkdir(parents=True)
    loader._quant_groups(model, path)
    proj = model.layers[0].self_attn.o_proj
    with torch.no_grad():
        proj.weight.copy_(proj.weight.flip(0))  # the rows reordered
    groups = loader._quant_groups(model, path)["layers.0.self_attn.o_proj"]
    assert quantized.reproduces(proj.weight, groups)
    assert torch.equal(groups[0], q4_groups(proj.weight)[0])
