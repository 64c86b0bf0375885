"""Every supported architecture against transformers' own implementation, on tiny random-weight
checkpoints built here (nothing downloaded): prompt logits within 1e-4 (fp32) and greedy tokens
identical through the engine, with prompts longer than the sliding window, chunked prefill,
prefix-cache hits and both kinds of preemption."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_no_leak, run_all
from test_model_reference import PagedSequence

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.loader import load_model
from kvpool.engine.models.hf_config import hf_config_to_model_config
from kvpool.engine.outputs import FinishedOutputs
from kvpool.errors import ConfigError
from kvpool.sched.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 128
WINDOW = 12  # shorter than the prompts below, so the windowed layers drop context
NEW_TOKENS = 16
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
ARCHS = {
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        attention_bias=True, mlp_bias=True)),
    "mistral-swa": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=24)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2-swa": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, sliding_window_pattern=2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        partial_rotary_factor=0.5, sliding_window=WINDOW)),
}
PROMPTS = [
    [1, *range(3, 40)],  # longer than the window
    [1, 7, 9, 11, 13, 5, 90, 100, 3, 3, 4],
    [1, *range(60, 30, -1)],
]


def _tokenizer_json(path: Path) -> None:
    """A word-level vocabulary of VOCAB tokens: the tests feed token ids, the engine needs one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    """(kvpool's model, transformers' model) of one architecture, same random weights."""
    return _build(request.param, tmp_path_factory)


def hf_model(name: str):
    """transformers' model of ARCHS[name], random weights of seed 0, eager attention."""
    config_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = getattr(transformers, config_cls)(**SHAPE, **extra)
        cfg._attn_implementation = "eager"
        return getattr(transformers, model_cls)(cfg).eval()


def _build(name: str, tmp_path_factory):
    hf = hf_model(name)
    path = tmp_path_factory.mktemp(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(path)
    _tokenizer_json(path)
    return name, path, load_model(path, dtype=torch.float32), hf


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prompt_logits_match_transformers_within_1e_4(checkpoint):
    name, _, ours, hf = checkpoint
    if "swa" in name or name in ("gemma2", "gemma3", "phi3"):
        assert any(w == WINDOW for w in ours.config.layer_windows), name
        assert len(PROMPTS[0]) > WINDOW
    for ids in PROMPTS:
        got = PagedSequence(ours).step(ids)
        assert (got - _hf_logits(hf, ids)).abs().max().item() <= 1e-4, (name, ids)
    assert ours.config.num_parameters() == sum(p.numel() for p in hf.parameters()), name


def test_chunked_prefill_and_decode_steps_match_transformers(checkpoint):
    """Chunks and single-token steps read the cache (windowed layers past the window)."""
    name, _, ours, hf = checkpoint
    ids = PROMPTS[0]
    seq = PagedSequence(ours, seed=5)
    got = torch.cat([seq.step(ids[:5]), seq.step(ids[5:6]), seq.step(ids[6:20]), seq.step(ids[20:21]),
                     *[seq.step([t]) for t in ids[21:]]])
    assert (got - _hf_logits(hf, ids)).abs().max().item() <= 1e-4, name


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_greedy_equals_transformers_through_prefix_hits_and_preemption(checkpoint, mode):
    name, path, ours, hf = checkpoint
    expected = [_hf_greedy(hf, p) for p in PROMPTS]
    engine = Engine(EngineConfig(
        model=str(path), dtype="float32", block_size=4, num_blocks=20, max_num_batched_tokens=16,
        preemption_mode=mode, swap_space="16MiB", swa_freeing=False,  # every block kept: see below for freeing
    ), loaded=ours)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    first = run_all(engine, PROMPTS, params)
    assert engine.scheduler.num_preemptions >= 1
    again = run_all(engine, PROMPTS, params)  # the finished prompts' blocks are cached now
    assert engine.scheduler.kv.stats.hits_tokens > 0
    for out in (first, again):
        assert [o.outputs[0].token_ids for o in out] == expected, name
    assert_no_leak(engine)


@pytest.mark.parametrize(("name", "mode"), [
    ("gemma3", "recompute"), ("gemma3", "swap"), ("qwen2-swa", "recompute"), ("qwen2-swa", "swap"),
    ("mistral-swa", "recompute"),
])
def test_window_blocks_freed_while_greedy_still_equals_transformers(name, mode, tmp_path_factory):
    """With SWA freeing on (full + window groups for Gemma-3 and Qwen2, one window group for
    Mistral): chunked prefill, preemption and prefix-cache hits give HF's greedy tokens, while
    each decoding sequence holds at most ceil(W/B)+1 blocks in every window group. Mistral's
    sequences never grow past admission, so nothing preempts: it serves, in fewer blocks than one
    request fills, what needed preemption with every block kept (the test above)."""
    _, path, ours, hf = _build(name, tmp_path_factory)
    B = 4
    all_windowed = name == "mistral-swa"
    expected = [_hf_greedy(hf, p) for p in PROMPTS]
    engine = Engine(EngineConfig(
        model=str(path), dtype="float32", block_size=B, num_blocks=10 if all_windowed else 12,
        max_num_batched_tokens=16,
        preemption_mode=mode, swap_space="16MiB",
    ), loaded=ours)
    kv = engine.scheduler.kv
    assert any(w == WINDOW for w in kv.group_windows), kv.group_windows
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done, most_held, finished = {}, 0, FinishedOutputs()
    while engine.has_unfinished():
        for out in finished.add(engine.step()):
            done[out.request_id] = out
        for group in engine.scheduler.running:
            for seq in group.live_seqs:
                if seq.num_computed_tokens >= seq.prompt_len and kv.has_seq(seq.seq_id):  # decoding
                    held = kv.blocks_held(seq.seq_id)
                    most_held = max([most_held] + [h for h, w in zip(held, kv.group_windows, strict=True) if w])
    assert [done[i].outputs[0].token_ids for i in ids] == expected, name
    if all_windowed:
        assert engine.scheduler.config.num_blocks < -(-(len(PROMPTS[0]) + NEW_TOKENS) // B)
    else:
        assert engine.scheduler.num_preemptions >= 1
    assert 0 < most_held <= -(-WINDOW // B) + 1
    for _ in range(2):  # alone, the prompt's blocks stay cached: the second run hits them
        (again,) = run_all(engine, PROMPTS[:1], params)
        assert again.outputs[0].token_ids == expected[0], name
    assert kv.stats.hits_tokens > 0
    assert_no_leak(engine)


# --- refusals: never load a checkpoint whose computation we would get wrong -----------------


def _config(model_type: str = "llama", **extra) -> dict:
    return {"model_type": model_type, **SHAPE, **extra}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "beta_fast": 32}}, "beta_fast"),
        ({"hidden_act": "relu"}, "hidden_act='relu'"),
        ({"some_new_feature": 3}, "some_new_feature=3"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"sliding_window": 64}, "sliding_window=64"),  # llama has no sliding window in HF either
        ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ],
)
def test_llama_config_with_unimplemented_field_is_refused_naming_it(extra, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("(", r"\(")):
        hf_config_to_model_config(_config(**extra), {})


@pytest.mark.parametrize(
    ("model_type", "extra", "named"),
    [
        ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
         "rope_type='longrope'"),
        ("phi3", {"rope_scaling": {"type": "su", "short_factor": [1.0]}}, "rope_type='su'"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3_text", {"sliding_window": 8, "rope_parameters": {
            "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "sliding_attention.rope_type"),
        ("gemma2", {"sliding_window": None}, "sliding_window is null"),
        ("qwen3", {"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        ("qwen2", {"attention_bias": True}, "attention_bias=True"),
        ("gemma3", {}, "model_type 'gemma3'"),
        ("mamba", {}, "model_type 'mamba'"),
    ],
)
def test_other_architectures_refuse_what_they_do_not_implement(model_type, extra, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        hf_config_to_model_config(_config(model_type, **extra), {})


def test_windows_and_features_are_read_from_old_style_configs():
    """transformers-4 configs (rope_theta, rope_scaling, rope_local_base_freq, the window
    pattern as an int, no layer_types) give the same per-layer plan transformers derives."""
    cfg = hf_config_to_model_config(_config(
        "gemma3_text", num_hidden_layers=6, head_dim=32, sliding_window=8, sliding_window_pattern=3,
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh"), {})
    assert cfg.layer_windows == (8, 8, None, 8, 8, None)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling_type, cfg.rope_scaling_factor) == (
        1e6, 1e4, "linear", 8.0)
    assert cfg.attn_scale == 16**-0.5 and cfg.embed_scale == 64**0.5 and cfg.qk_norm
    qwen = hf_config_to_model_config(_config(
        "qwen2", use_sliding_window=False, sliding_window=32768, max_window_layers=2), {})
    assert qwen.layer_windows == () and qwen.qkv_bias and not qwen.o_bias
    swa = hf_config_to_model_config(_config(
        "qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2), {})
    assert swa.layer_windows == (None, None, 64, 64)


def test_bf16_and_fp16_safetensors_load_as_their_float32_values(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**SHAPE, head_dim=16)
    for dtype in (torch.bfloat16, torch.float16):
        path = tmp_path / str(dtype)
        transformers.Qwen3ForCausalLM(cfg).to(dtype).save_pretrained(path)
        _tokenizer_json(path)
        assert json.loads((path / "config.json").read_text())["dtype"] in ("bfloat16", "float16")
        ours = load_model(path, dtype=torch.float32)
        ref = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert torch.equal(ours.model.embed_tokens.weight, ref.model.embed_tokens.weight)
        assert (PagedSequence(ours).step(PROMPTS[1]) - _hf_logits(ref, PROMPTS[1])).abs().max() <= 1e-4


STORE_PROMPT = PROMPTS[0]  # 38 tokens: 9 reusable blocks of 4; the window (12) reads the last 3


def _store_options(tier: str, tmp_path: Path, request) -> dict:
    if tier == "host":
        return {"kv_host_memory": "16MiB"}
    if tier == "disk":
        return {"kv_disk_path": str(tmp_path), "kv_disk_size": "64MiB"}
    import redis

    port = request.getfixturevalue("redis_server").port
    redis.Redis(port=port, db=3).flushdb()  # this test's own database: nothing left by an earlier one
    return {"kv_remote": f"redis://127.0.0.1:{port}/3"}


def _damage(engine: Engine, tier: str, tmp_path: Path, request, group: int, index: int) -> None:
    """Flip a bit in the middle of group `group`'s stored block `index` of STORE_PROMPT."""
    kv = engine.scheduler.kv
    key = engine.kv_store.store.key(kv.group_keys(kv.prompt_hashes(STORE_PROMPT), group)[index])
    if tier == "disk":
        from kvpool.store.disk import SUBDIR

        f = tmp_path / SUBDIR / (key.encode().hex() + ".kvb")
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x10
        f.write_bytes(bytes(data))
    else:
        import redis

        raw = redis.Redis(port=request.getfixturevalue("redis_server").port, db=3)
        data = bytearray(raw.get(key))
        data[len(data) // 2] ^= 0x10
        raw.set(key, bytes(data))


@pytest.mark.parametrize(("name", "tier", "layerwise"), [
    ("gemma3", "host", True), ("gemma3", "disk", True), ("gemma3", "redis", True),
    pytest.param("gemma3", "disk", False, marks=pytest.mark.slow),
    pytest.param("qwen2-swa", "disk", True, marks=pytest.mark.slow),
    pytest.param("qwen2-swa", "host", False, marks=pytest.mark.slow),
])
def test_a_layer_grouped_model_serves_its_prefix_from_each_store_tier(name, tier, layerwise, tmp_path,
                                                                      tmp_path_factory, request):
    """SWA freeing on and a store tier: a prefix whose device copy is gone comes back from the
    tier, every full group's blocks and each window group's last ceil((W-1)/B) only, and greedy
    output equals HF's; a corrupted block is recomputed (its CRC fails), still HF's tokens, and
    no block leaks."""
    _, path, ours, hf = _build(name, tmp_path_factory)
    expected = _hf_greedy(hf, STORE_PROMPT)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)

    options = _store_options(tier, tmp_path, request)

    def engine_with_store() -> Engine:
        return Engine(EngineConfig(model=str(path), dtype="float32", block_size=4, num_blocks=40,
                                   max_num_batched_tokens=16, kv_layerwise_load=layerwise, **options), loaded=ours)

    writer = engine_with_store()
    kv = writer.scheduler.kv
    assert kv.num_groups == 2 and kv.group_windows == (None, WINDOW)
    (first,) = run_all(writer, [STORE_PROMPT], params)
    assert first.outputs[0].token_ids == expected

    def same_as_computed(out) -> bool:  # tokens, and their logprobs as when every block was computed
        got, want = out.outputs[0], first.outputs[0]
        return got.token_ids == expected and abs(got.cumulative_logprob - want.cumulative_logprob) <= 1e-4

    writer.kv_store.store.flush()
    if tier == "host":  # the tier lives in this process: drop the device copy instead of restarting
        reader = writer
        kv.reset_prefix_cache()
    else:
        writer.close()
        reader = engine_with_store()
    blocks, window_blocks = (len(STORE_PROMPT) - 1) // 4, -(-(WINDOW - 1) // 4)
    (again,) = run_all(reader, [STORE_PROMPT], params)
    assert same_as_computed(again)
    assert reader.scheduler.num_external_hit_tokens == 4 * blocks
    assert reader.kv_store.loaded_blocks == blocks + window_blocks  # one full group, one window group
    if layerwise:
        assert reader.kv_store.last_layerwise is not None
    assert_no_leak(reader)
    reader.close()
    if tier == "host":
        return
    for group, index in ((1, blocks - 1), (0, 2)):  # a window group's block, then a full group's
        reader.kv_store.store.flush()
        _damage(reader, tier, tmp_path, request, group, index)
        damaged = engine_with_store()
        (out,) = run_all(damaged, [STORE_PROMPT], params)
        assert same_as_computed(out)
        assert sum(damaged.kv_store.store.stats()[t.name].bad_entries.get("checksum", 0)
                   for t in damaged.kv_store.store.tiers) == 1
        assert damaged.scheduler.num_external_hit_tokens < 4 * blocks
        assert_no_leak(damaged)
        damaged.close()
        reader = damaged
