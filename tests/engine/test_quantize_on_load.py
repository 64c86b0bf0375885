"""`--quantization int8 | q4` on an HF checkpoint of the bundled model's size: the decode
kernels read the groups wherever they read a GGUF file's, and greedy tokens and logprobs stay
within bounds measured against the unquantized checkpoint (as `kvpool bench kv-accuracy`
scores KV dtypes). The checkpoint is the bundled model's weights moved off their 4-bit grid by
up to half a step (a bf16 model no quantizer has touched), so q4 on load has real work to do."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvpool.bench.kv_accuracy import PROMPTS, _generate, _row, _teacher_forced
from kvpool.engine import loader
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.layers.linear import Q4Linear, Q4TileLinear, Q8Linear, Q8TileLinear
from kvpool.engine.models.quantize_on_load import q4_quantize, q8_quantize
from kvpool.engine.models.quantized import GROUP

OUTPUT_LEN = 32


def bundled_hf_dir(path: Path) -> Path:
    """An HF directory of the bundled model's shape, tokenizer and (noisy) weights, in bf16."""
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    source = loader.default_model_path()
    config, weights, tokenizer = loader._read_gguf_cached(source)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, w in weights:
        if w.dim() == 2 and w.shape[1] % GROUP == 0:
            groups = w.reshape(-1, GROUP)
            span = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
            if "embed" in name:  # Q8_0 in the file: its step is a group's largest magnitude / 127
                span = groups.abs().amax(-1, keepdim=True) / 127
            w = (groups + (torch.rand(groups.shape, generator=gen) - 0.5) * span).reshape(w.shape)
        tensors[name] = w.to(torch.bfloat16).contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    tokenizer.fast.save(str(path / "tokenizer.json"))
    eos = config.eos_token_ids[0]
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tokenizer.chat_template, "eos_token": tokenizer.fast.id_to_token(eos)}))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": eos, "torch_dtype": "bfloat16"}))
    return path


def _engine(path: Path | None, dtype: str, quantization: str | None = None) -> Engine:
    return Engine(EngineConfig(model=None if path is None else str(path), dtype=dtype, quantization=quantization,
                               num_blocks=256))


def _served(engine: Engine) -> tuple[int, int, bool]:
    """(projections on 4-bit groups, on 8-bit groups, whether the head is on 8-bit groups)."""
    model = engine.runner.model
    kinds = [type(m) for m in model.modules()]
    eight = (Q8Linear, Q8TileLinear)
    return (kinds.count(Q4Linear) + kinds.count(Q4TileLinear), sum(map(kinds.count, eight)),
            type(model.head) in eight)


@cache
def _reference(path: Path, dtype: str, n: int):
    engine = _engine(path, dtype)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    tokens = _generate(engine, prompts, n)
    seqs = [p + t for p, t in zip(prompts, tokens, strict=True)]
    starts = [len(p) for p in prompts]
    return prompts, tokens, seqs, starts, _teacher_forced(engine, seqs, starts)


def accuracy(path: Path, quantization: str, dtype: str, n: int = OUTPUT_LEN) -> dict:
    """Greedy agreement and teacher-forced logprob deltas of `quantization` against the
    unquantized checkpoint in `dtype`, and what the quantized engine serves from groups."""
    prompts, ref_tokens, seqs, starts, (ref_lp, ref_top) = _reference(path, dtype, n)
    engine = _engine(path, dtype, quantization)
    tokens = _generate(engine, prompts, n)
    lp, top = _teacher_forced(engine, seqs, starts)
    row = _row(quantization, "-", ref_tokens, tokens, ref_lp, lp, ref_top, top, None)
    return {"greedy_tokens_equal": row.greedy_tokens_equal, "first_divergence": row.first_divergence,
            "top1": row.teacher_forced_top1_agreement, "mean_dlogprob": row.mean_abs_logprob_diff,
            "max_dlogprob": row.max_abs_logprob_diff, "served": _served(engine)}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return bundled_hf_dir(tmp_path_factory.mktemp("bundled-hf"))


@pytest.mark.parametrize("kind", ["q4", "int8"])
def test_groups_give_back_every_weight_within_half_a_step(kind):
    w = torch.randn(64, 96) * torch.linspace(0.1, 3, 96)
    groups, values = (q4_quantize if kind == "q4" else q8_quantize)(w)
    step = groups[1].repeat_interleave(GROUP, dim=1)
    assert ((values - w).abs() <= step / 2 + 1e-6).all()
    assert groups[0].dtype == (torch.uint8 if kind == "q4" else torch.int8) and groups[0].shape[1] == (
        48 if kind == "q4" else 96)


# Measured 2026-12-03 on this AVX512-BF16 EPYC, bf16, 4 prompts x 32 greedy tokens (128), against the
# unquantized checkpoint in bf16 (for scale: bf16 against float32, unquantized, 64 tokens: greedy
# equal 0.40, first divergence at tokens 5, 28, -, 2; top-1 0.98, mean |dlogprob| 0.023):
#   int8: greedy equal 0.37 (first divergence 5, 1, -, 2), top-1 0.93, mean |dlogprob| 0.048 (max 0.31)
#   q4:   greedy equal 0.05 (first divergence 2, 0, 1, 1), top-1 0.70, mean |dlogprob| 0.50 (max 2.8)
# q4 is Q4_1's min-max quantizer (llama.cpp's reference one) on a 135M model, the size that loses
# most; its free-running greedy tokens part within the first few, so only int8's are bounded.
# The bounds leave room for another CPU's summation order.
BOUNDS = {"int8": (0.2, 0.88, 0.08), "q4": (0.0, 0.6, 0.65)}  # greedy equal >=, top-1 >=, mean |dlogprob| <=


@pytest.mark.parametrize("kind", ["q4", "int8"])
def test_quantized_checkpoint_stays_close_to_the_unquantized_one_and_decodes_from_groups(hf_dir, kind):
    got = accuracy(hf_dir, kind, "bfloat16")
    greedy, top1, mean = BOUNDS[kind]
    assert got["greedy_tokens_equal"] >= greedy and got["top1"] >= top1 and got["mean_dlogprob"] <= mean, got
    q4, q8, head = _served(_engine(None, "bfloat16"))  # what the kernels serve of the bundled GGUF here
    assert got["served"] == ((q4, q8, head) if kind == "q4" else (0, q4 + q8, head)), got


def test_an_unquantized_checkpoint_serves_nothing_from_groups(hf_dir):
    assert _served(_engine(hf_dir, "bfloat16")) == (0, 0, False)
