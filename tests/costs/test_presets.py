"""Model/hardware presets: KV sizes, FLOPs and tensor-parallel helpers."""

import pytest

from kvpool.costs.presets import HARDWARE, MODELS, TensorParallel, get_hardware, get_model
from kvpool.errors import ConfigError


def test_gqa_kv_bytes_per_token_uses_kv_heads():
    assert get_model("llama2-70b").kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2 == 327_680


def test_mha_kv_bytes_per_token_opt13b():
    assert get_model("opt-13b").kv_bytes_per_token() == 2 * 40 * 5120 * 2 == 819_200


def test_smollm2_is_fp32_gqa_with_tied_embeddings_param_count():
    m = get_model("SmolLM2-135M")
    assert (m.num_heads, m.num_kv_heads, m.head_dim, m.dtype_bytes) == (9, 3, 64, 4)
    assert m.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 4
    assert m.weight_bytes() == m.params * 4


def test_flops_per_token_grows_with_context_by_attention_terms():
    m = get_model("llama2-7b")
    assert m.flops_per_token(0) == 2 * m.params
    assert m.flops_per_token(1000) - m.flops_per_token(0) == 32 * 4 * 32 * 128 * 1000
    # A prefill chunk's attention FLOPs equal the sum over its tokens' contexts.
    per_token = sum(m.flops_per_token(c) - 2 * m.params for c in range(91, 101))
    assert m.attention_flops(10, 100) == per_token


def test_lookup_errors_name_the_choices():
    with pytest.raises(ConfigError, match="llama2-7b"):
        get_model("gpt-5")
    with pytest.raises(ConfigError, match="h100-80gb"):
        get_hardware("tpu")


def test_tensor_parallel_splits_weights_and_kv_and_adds_allreduce():
    m, hw = get_model("llama2-70b"), get_hardware("a100-80gb")
    with pytest.raises(ConfigError, match="weights"):
        TensorParallel(m, hw, 1).kv_capacity_tokens()
    tp4, tp8 = TensorParallel(m, hw, 4), TensorParallel(m, hw, 8)
    assert tp4.weight_bytes_per_gpu() == m.weight_bytes() / 4
    assert tp8.kv_bytes_per_token_per_gpu() == m.kv_bytes_per_token() / 8
    assert tp8.kv_capacity_tokens() > tp4.kv_capacity_tokens() > 0
    assert TensorParallel(m, hw, 1).allreduce_seconds(100) == 0
    assert tp8.allreduce_seconds(200) > tp8.allreduce_seconds(100) > 0
    with pytest.raises(ConfigError, match="tp=3"):
        TensorParallel(m, hw, 3)


def test_every_preset_is_consistent():
    for m in MODELS.values():
        assert m.num_heads % m.num_kv_heads == 0
        assert m.params > 0 and m.kv_bytes_per_token() > 0
    for h in HARDWARE.values():
        assert h.peak_flops > 0 and h.mem_bandwidth > 0 and h.mem_bytes > 0
