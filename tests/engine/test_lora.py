"""LoRA adapters in the engine, against transformers + peft on a tiny random Llama built here
(nothing downloaded): two adapters made with peft, served together with the base model in one
batch; each request's greedy tokens equal HF+peft's for its adapter (float32), and in bf16 and
float32 equal the tokens the request gets alone. A prefix cached or stored under one adapter is
never a hit for another adapter or the base model (device cache, KV events, host and disk tiers).
Adapters kvpool does not compute are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_no_leak
from lora_models import hf_base, make_adapter, tiny_llama

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import step_until_done
from kvpool.engine.loader import load_model
from kvpool.engine.lora.adapters import AdapterInUse, enable_lora
from kvpool.engine.lora.config import LoraConfig
from kvpool.engine.lora.peft_dir import load_adapter
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.sched.sampling_params import SamplingParams

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

NEW_TOKENS = 10
PROMPTS = [[1, *range(3, 30)], [1, 7, 9, 11, 13, 5, 90, 100, 3, 3, 4], [1, *range(60, 40, -1)]]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (target modules, r, lora_alpha, use_rslora, seed)
    "A": (["q_proj", "v_proj"], 4, 8, False, 1),
    "B": (ALL_LINEAR, 8, 16, True, 2),
}
WHO = (None, "A", "B")  # None: the base model


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny random Llama directory (`base`) and the adapters of ADAPTERS beside it."""
    root = tmp_path_factory.mktemp("lora")
    tiny_llama(root / "base")
    for name, (targets, r, alpha, rslora, seed) in ADAPTERS.items():
        make_adapter(root / "base", root / name, targets, r, alpha, rslora, seed)
    return root


def hf_greedy(root: Path, adapter: str | None) -> list[list[int]]:
    model = hf_base(root / "base")
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, root / adapter).eval()
    out = []
    for ids in PROMPTS:
        with torch.no_grad():
            got = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(got[0, len(ids):].tolist())
    return out


def lora_engine(root: Path, dtype: str = "float32", **options) -> Engine:
    engine = Engine(EngineConfig(model=str(root / "base"), dtype=dtype, block_size=4,
                                 **{"num_blocks": 128, **options}))
    lora = enable_lora(engine, LoraConfig(max_loras=2, max_lora_rank=8))
    for name in ADAPTERS:
        lora.load(name, root / name)
    return engine


def greedy(adapter: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, lora=adapter)


def run_mixed(engine: Engine, who=WHO, prompts=PROMPTS) -> dict[tuple[str | None, int], list[int]]:
    """Every (adapter, prompt) pair added before the first step: one batch."""
    ids = {(a, i): engine.add_request(p, greedy(a)) for a in who for i, p in enumerate(prompts)}
    done = step_until_done(engine)
    return {k: done[rid].outputs[0].token_ids for k, rid in ids.items()}


def test_requests_for_two_adapters_and_the_base_in_one_batch_each_get_hf_peft_greedy_tokens(root):
    engine = lora_engine(root)
    got = run_mixed(engine)
    for a in WHO:
        assert [got[(a, i)] for i in range(len(PROMPTS))] == hf_greedy(root, a), a
    assert got[("A", 0)] != got[(None, 0)] and got[("B", 0)] != got[(None, 0)]  # the adapters act
    assert_no_leak(engine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_mixed_batch_gives_each_request_exactly_the_tokens_it_gets_alone(root, dtype):
    """The per-row deltas never leak into another row: base rows beside adapter rows compute
    what they compute in a base-only step (the fused paths), adapter rows what they do alone."""
    engine = lora_engine(root, dtype)
    mixed = run_mixed(engine)
    engine.scheduler.kv.reset_prefix_cache()
    for a in WHO:
        for i, p in enumerate(PROMPTS):
            alone = run_mixed(engine, (a,), [p])[(a, 0)]
            engine.scheduler.kv.reset_prefix_cache()
            assert alone == mixed[(a, i)], (dtype, a, i)


def _cached(engine: Engine, adapter: str | None, prompt: list[int]) -> int:
    rid = engine.add_request(prompt, greedy(adapter))
    return step_until_done(engine)[rid].num_cached_tokens


def test_a_prefix_cached_under_one_adapter_is_no_device_hit_for_another_or_the_base(root):
    engine = lora_engine(root, publish_kv_events=True)
    prompt = PROMPTS[0]
    assert _cached(engine, "A", prompt) == 0
    stored_a = set(engine.drain_kv_events().stored)
    assert stored_a
    assert _cached(engine, "B", prompt) == 0
    assert _cached(engine, None, prompt) == 0
    stored_others = set(engine.drain_kv_events().stored)
    assert stored_others and not stored_a & stored_others  # the conductor's index never mixes them
    assert _cached(engine, "A", prompt) > 0  # A's own prefix is still a hit
    assert_no_leak(engine)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prefix_stored_under_one_adapter_is_no_store_hit_for_another_or_the_base(root, tier, tmp_path):
    store = {"kv_host_memory": "4MiB"} if tier == "host" else {"kv_disk_path": str(tmp_path), "kv_disk_size": "8MiB"}
    engine = lora_engine(root, kv_layerwise_load=False, **store)
    prompt = PROMPTS[0]
    want = hf_greedy(root, "A")[0]
    rid = engine.add_request(prompt, greedy("A"))
    assert step_until_done(engine)[rid].outputs[0].token_ids == want
    engine.kv_store.store.flush()  # the writes are asynchronous
    engine.scheduler.kv.reset_prefix_cache()  # from here a hit can only come from the store
    assert _cached(engine, "B", prompt) == 0
    engine.scheduler.kv.reset_prefix_cache()
    assert _cached(engine, None, prompt) == 0
    engine.scheduler.kv.reset_prefix_cache()
    rid = engine.add_request(prompt, greedy("A"))
    out = step_until_done(engine)[rid]
    assert out.num_cached_tokens > 0 and out.outputs[0].token_ids == want  # A's own blocks, from the store
    engine.close()


def test_an_adapter_in_use_is_not_unloaded_and_an_unknown_one_is_refused(root):
    engine = lora_engine(root)
    engine.add_request(PROMPTS[0], greedy("A"))
    engine.step()
    with pytest.raises(AdapterInUse, match="in use by 1"):
        engine.lora.unload("A", engine.scheduler.running)
    step_until_done(engine)
    engine.lora.unload("A", engine.scheduler.running)
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'A'"):
        engine.add_request(PROMPTS[0], greedy("A"))
    engine.lora.load("C", root / "A")
    with pytest.raises(InvalidRequest, match="--max-loras"):
        engine.lora.load("D", root / "A")
    with pytest.raises(InvalidRequest, match="cache_salt may not contain NUL"):
        engine.add_request(PROMPTS[0], greedy(None), cache_salt="x\x00lora:abc")
    assert_no_leak(engine)


def test_the_identity_is_stable_for_the_same_files_and_changes_with_the_weights(root, tmp_path):
    config = load_model(str(root / "base")).config
    cpu = torch.device("cpu")
    first, again = (load_adapter("A", root / "A", config, 8, cpu) for _ in range(2))
    assert first.key == again.key
    assert load_adapter("A2", root / "A", config, 8, cpu).key != first.key  # the name is part of it
    shutil.copytree(root / "B", tmp_path / "A")
    assert load_adapter("A", tmp_path / "A", config, 8, cpu).key != first.key


def _edited(root: Path, tmp_path: Path, **config_fields) -> Path:
    path = tmp_path / "edited"
    shutil.copytree(root / "A", path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **config_fields}))
    return path


@pytest.mark.parametrize(("fields", "named"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all'"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
])
def test_adapter_configs_kvpool_does_not_compute_are_refused_by_name(root, tmp_path, fields, named):
    config = load_model(str(root / "base")).config
    with pytest.raises(ConfigError, match=named):
        load_adapter("x", _edited(root, tmp_path, **fields), config, 8, torch.device("cpu"))


def test_a_rank_over_the_limit_and_a_target_outside_the_layers_are_refused_by_name(root):
    config = load_model(str(root / "base")).config
    with pytest.raises(ConfigError, match="rank 8 exceeds --max-lora-rank 4"):
        load_adapter("B", root / "B", config, 4, torch.device("cpu"))
    head = make_adapter(root / "base", root / "head", ["q_proj", "lm_head"], 4, 8)
    with pytest.raises(ConfigError, match="lm_head"):
        load_adapter("head", head, config, 8, torch.device("cpu"))
