"""HF checkpoints as the ecosystem writes them: config.json with every field transformers
writes plus the extras real checkpoints carry, sharded directories with an index, bf16 files
read straight into the run dtype, never searched for 4-bit groups, and refused before they are
read when they cannot fit in memory. Tiny random models built here (nothing downloaded)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_no_leak, run_all
from test_architectures import PROMPTS, _hf_greedy, _tokenizer_json, hf_model

from kvpool.engine import loader
from kvpool.engine.config import KV_AUTO_CONTEXTS, KV_AUTO_MIN, EngineConfig, kv_budget
from kvpool.engine.engine import Engine
from kvpool.engine.layers.linear import Q4Linear, Q8Linear
from kvpool.engine.models import hf_weights, quantized
from kvpool.engine.models.hf_config import hf_config_to_model_config
from kvpool.errors import ConfigError
from kvpool.sched.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
# Keys real checkpoints carry beside transformers' own: SmolLM2's (nanotron conversion,
# transformers.js), a GGUF conversion's, Unsloth's, older transformers' and a tokenizer's ids.
REAL_WORLD_EXTRAS = {
    "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2", "_name_or_path": "/tmp/some/where",
    "_commit_hash": None, "unk_token_id": 0, "sep_token_id": None, "torch_dtype": "float32",
    "transformers_version": "4.42.3", "is_llama_config": True, "rope_interleaved": False,
    "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
    "unsloth_version": "2024.9", "unsloth_fixed": True, "use_cache": True, "output_attentions": False,
    "pretraining_tp": 1, "architectures": ["SomethingForCausalLM"],
}


def _save(name: str, path: Path, shard: str | None = None, dtype: torch.dtype = torch.float32,
          extras: dict | None = None):
    """transformers' model of ARCHS[name] saved to `path` with its full config (every field
    `to_dict` holds, defaults included) plus `extras`; returns the model."""
    hf = hf_model(name).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    full = json.loads(hf.config.to_json_string(use_diff=False))
    (path / "config.json").write_text(json.dumps({**full, **(extras or {})}))
    _tokenizer_json(path)
    return hf


def _greedy(path: Path, **options) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(path), dtype="float32", block_size=4, num_blocks=64, **options))
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    out = [o.outputs[0].token_ids for o in run_all(engine, PROMPTS, params)]
    assert_no_leak(engine)
    return out


def _expected(hf) -> list[list[int]]:
    return [_hf_greedy(hf, p)[:NEW_TOKENS] for p in PROMPTS]


@pytest.mark.parametrize("name", ["llama3-rope", "mistral-swa", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_full_save_pretrained_config_with_real_world_metadata_loads_and_gives_hf_greedy_tokens(name, tmp_path):
    hf = _save(name, tmp_path, extras=REAL_WORLD_EXTRAS)
    config = json.loads((tmp_path / "config.json").read_text())
    assert {"_name_or_path", "id2label", "output_hidden_states", "unk_token_id"} <= set(config)
    assert _greedy(tmp_path) == _expected(hf), name


def test_sharded_checkpoint_loads_through_its_index_ignoring_stray_files(tmp_path):
    """A Mistral-style directory: shards, their index, and a consolidated copy under other
    tensor names that the index does not list (reading it would refuse unknown tensors)."""
    hf = _save("qwen3", tmp_path, shard="40KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / hf_weights.INDEX).is_file()
    from safetensors.torch import save_file

    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, tmp_path / "consolidated.safetensors")
    assert _greedy(tmp_path) == _expected(hf)


def test_an_index_naming_a_missing_shard_is_refused_by_name(tmp_path):
    _save("llama3-rope", tmp_path, shard="40KB")
    index = json.loads((tmp_path / hf_weights.INDEX).read_text())
    gone = sorted(tmp_path.glob("model-*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(ConfigError, match=gone.name):
        loader.load_model(tmp_path)
    assert gone.name in index["weight_map"].values()


def test_a_bf16_checkpoint_is_read_into_bf16_parameters_without_group_recovery(tmp_path, monkeypatch):
    """Its values arrive as stored (no float32 copy), no 4/8-bit group recovery runs (an HF file
    has none: on 1.7B it took 100 s), and packing serves no projection from groups."""
    hf = _save("qwen2", tmp_path, dtype=torch.bfloat16)
    for fn in ("q4_groups", "q8_groups", "model_groups", "reproduces"):
        monkeypatch.setattr(quantized, fn, lambda *a, fn=fn: pytest.fail(f"{fn} ran on an HF checkpoint"))
    ours = loader.load_model(tmp_path, dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(ours.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    q, k, v = (getattr(hf.model.layers[1].self_attn, f"{p}_proj").weight for p in "qkv")
    assert torch.equal(ours.model.layers[1].self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert ours.model.quant_groups == {}
    for dtype in ("bfloat16", "float32"):
        engine = Engine(EngineConfig(model=str(tmp_path), dtype=dtype, num_blocks=16, cpu_q4_kernels=True))
        assert not any(isinstance(m, Q4Linear | Q8Linear) for m in engine.runner.model.modules()), dtype


def test_a_model_that_cannot_fit_in_memory_is_refused_before_it_is_read(tmp_path, monkeypatch):
    _save("llama3-rope", tmp_path)
    monkeypatch.setattr(hf_weights, "read_into", lambda *a: pytest.fail("read a model that cannot fit"))
    weights = loader.weight_bytes(hf_config_to_model_config(json.loads((tmp_path / "config.json").read_text()), {}),
                                  torch.float32)
    monkeypatch.setattr(loader, "available_host_memory", lambda: weights + 2**20)
    with pytest.raises(ConfigError, match=r"does not fit in memory: .* KV budget 0\.50 GiB.* is available"):
        loader.load_model(tmp_path, reserve_bytes=2**29)
    with pytest.raises(ConfigError, match="does not fit in memory"):
        Engine(EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_memory="512MiB"))


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"rope_interleaved": True}, "rope_interleaved=True"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
        ({"attention_chunk_size": 8192}, "attention_chunk_size=8192"),
        ({"num_experts": 8}, "num_experts=8"),
        ({"use_mrope": True}, "use_mrope=True"),
    ],
)
def test_a_field_that_changes_the_computation_is_still_refused_by_name(extra, named, tmp_path):
    _save("llama3-rope", tmp_path, extras={**REAL_WORLD_EXTRAS, **extra})
    with pytest.raises(ConfigError, match=named):
        loader.load_model(tmp_path)


def test_auto_kv_budget_follows_the_model_and_the_free_memory():
    """A 1.7B MHA model (24 layers x 32 KV heads x 64, bf16: 192 KiB a token) gets room for
    two 8k sequences where memory allows (the default workload needs 6,752 tokens; 1 GiB held
    5,456), half the free memory where it does not; a 135M GQA model keeps the 1 GiB floor."""
    per_token = 2 * 24 * 32 * 64 * 2
    big = kv_budget("auto", per_token, 8192, available=20 * 2**30)
    assert big == KV_AUTO_CONTEXTS * 8192 * per_token and big // per_token >= 2 * 6752
    assert kv_budget("auto", per_token, 8192, available=4 * 2**30) == 2 * 2**30
    assert kv_budget("auto", 2 * 30 * 3 * 64 * 2, 8192, available=20 * 2**30) == KV_AUTO_MIN
    assert kv_budget("0.25", per_token, 8192, available=8 * 2**30) == 2 * 2**30
    assert kv_budget("2GiB", per_token, 8192, available=1) == 2 * 2**30


def test_quantization_of_a_gguf_model_is_refused_by_name():
    with pytest.raises(ConfigError, match="quantization='q4'.*GGUF"):
        EngineConfig(quantization="q4")
    with pytest.raises(ConfigError, match="quantization='q4'.*GGUF"):
        loader.load_model(None, quantization="q4")
    with pytest.raises(ConfigError, match="quantization must be one of int8, q4"):
        EngineConfig(quantization="fp4")
