"""float32 decode rows on 4-bit / 8-bit groups give the dense oneDNN GEMM's bits (the batch-
invariant path, docs/determinism.md): a row's projections are the same whether a step's row
count sends it to the lanes kernels (decode) or to the dense GEMM (prefill), and a kernel whose
order does not match is refused at load, leaving that projection dense."""

from __future__ import annotations

import pytest
import torch
from test_batch_invariance import _exact_weight

from kvpool.engine.kernels import batch_invariant, q4_lanes_available
from kvpool.engine.layers.linear import PackedLinear, Q4Linear, Q8Linear, can_pack_weights
from kvpool.engine.models.quantized import (
    LANES_HEAD_MAX_ROWS_F32,
    LANES_MAX_ROWS_F32,
    lanes_groups,
    q4_groups,
    q8_groups,
)

pytestmark = [
    pytest.mark.skipif(not q4_lanes_available(float32=True), reason="no AVX2 + FMA lanes kernels in this build"),
    pytest.mark.skipif(not can_pack_weights("cpu", torch.float32), reason="no oneDNN"),
]


@pytest.mark.parametrize("bits", [4, 8])
# the bundled model's QKV, o, gate_up and down shapes (K 1536: oneDNN's K block is 1024), a head-sized N
@pytest.mark.parametrize("shape", [(960, 576), (576, 576), (3072, 576), (576, 1536), (64, 3072), (4096, 576)])
def test_float32_decode_rows_equal_the_dense_prefill_rows_bit_for_bit(bits, shape):
    w = _exact_weight(*shape, bits, seed=shape[0] + shape[1])
    groups = q4_groups(w) if bits == 4 else q8_groups(w)
    dense = PackedLinear(w, None)
    lanes = lanes_groups(dense, groups, torch.float32)
    assert lanes is not None and lanes[0].dim() == 4
    limit = LANES_MAX_ROWS_F32 if bits == 4 else LANES_HEAD_MAX_ROWS_F32
    lin = (Q4Linear if bits == 4 else Q8Linear)(dense, lanes, None, max_rows=limit)
    x = torch.randn(70, shape[1], generator=torch.Generator().manual_seed(2))
    prefill = dense(x)  # every row through the dense GEMM, as a 70-token prefill chunk runs
    for rows in sorted({1, 2, 3, 5, 7, 8, 9, limit, limit + 1, 33}):
        assert torch.equal(lin(x[:rows]), prefill[:rows]), rows
    assert torch.equal(lin(x[:limit]), (torch.ops.kvpool.q4_linear if bits == 4 else torch.ops.kvpool.q8_linear)(
        x[:limit], *lanes))  # the rows up to the limit did run the lanes kernel


def test_a_dense_gemm_in_another_order_is_refused_and_the_projection_stays_dense():
    """Correctly rounded dot products (float64, then float32) are not oneDNN's chain order: no
    K block reproduces them, so lanes_groups refuses rather than serve different bits."""
    w = _exact_weight(128, 1536, 4, seed=7)

    def exact_sums(x: torch.Tensor) -> torch.Tensor:
        return (x.double() @ w.double().T).float()

    assert lanes_groups(exact_sums, q4_groups(w), torch.float32) is None
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        lanes_groups(exact_sums, q4_groups(w), torch.float16)


def test_lanes_kernels_refuse_groups_they_were_not_repacked_for():
    w = _exact_weight(64, 576, 4, seed=3)
    lanes = torch.ops.kvpool.q4_repack(*q4_groups(w), 576, True)
    for k in (288, 1152):  # rows of another K than the groups'
        with pytest.raises(RuntimeError, match=r"q4_linear \(float32 lanes\)"):
            torch.ops.kvpool.q4_linear(torch.randn(2, k), *lanes)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.kvpool.q4_repack(*q4_groups(_exact_weight(48, 576, 4, seed=3)), 576, True)


@pytest.mark.skipif(not batch_invariant(), reason="KVPOOL_BATCH_INVARIANT=0")
def test_float32_model_decodes_on_lanes_kernels_in_the_native_loop():
    """The bundled model in float32: every projection and the head keep their groups for decode
    rows (bit for bit the dense GEMM), so decode steps take the native layer loop again."""
    from kvpool.engine.kernels import decode_loop_available
    from kvpool.engine.loader import load_model

    model = load_model(None, dtype=torch.float32).model
    model.pack_cpu_weights(q4_kernels=True)
    projs = [p for layer in model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(type(p) is Q4Linear and p.groups[0].dim() == 4 for p in projs)
    assert model.q4_rows == LANES_MAX_ROWS_F32
    assert isinstance(model.head, Q8Linear) and model.head.max_rows == LANES_HEAD_MAX_ROWS_F32
    assert (model.decode_loop is not None) == decode_loop_available()
