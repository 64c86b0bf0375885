"""#27 acceptance: a request's greedy tokens and logprobs are the cold run's bits (`==` on floats)
whether its prompt KV came from another request's prefix hit, a store tier (host DRAM, disk,
Redis, Mooncake Store), recompute or swap preemption; for the bundled model and a Gemma-3-like
layer-grouped model with sliding windows, with the default KV dtype, int8 and fp8 KV, in bfloat16
and float32 (docs/determinism.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_architectures import PROMPTS as WINDOWED_PROMPTS
from test_architectures import WINDOW, _tokenizer_json, hf_model
from test_engine import assert_no_leak

from kvpool.bench.determinism import Served, greedy, random_prompts, serve
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.loader import LoadedModel, load_model

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PARAMS = greedy(16)


@pytest.fixture(scope="module", params=list(DTYPES))
def bundled(request) -> tuple[str, LoadedModel]:
    return request.param, load_model(None, dtype=DTYPES[request.param])


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """A tiny random Gemma-3 (full + sliding-window layer groups, window 12) saved as a checkpoint."""
    path = tmp_path_factory.mktemp("gemma3-exact")
    hf_model("gemma3").save_pretrained(path)
    _tokenizer_json(path)
    return path


def _targets(loaded: LoadedModel, seed: int = 7) -> tuple[list[list[int]], list[list[int]]]:
    """Two target prompts and four crowd prompts of the bundled model's vocabulary."""
    rng = np.random.default_rng(seed)
    vocab = loaded.config.vocab_size
    return random_prompts(rng, vocab, 2, 14, 22), random_prompts(rng, vocab, 4, 8, 16)


def _engine(loaded: LoadedModel, dtype: str, **kw) -> Engine:
    return Engine(EngineConfig(**{"dtype": dtype, "num_blocks": 256, "block_size": 4, "threads": 1, **kw}),
                  loaded=loaded)


def _cold(loaded, dtype, targets, **kw) -> list[Served]:
    return [serve(_engine(loaded, dtype, **kw), [t], PARAMS)[0] for t in targets]


def _prefix_hit(loaded, dtype, targets, **kw) -> list[Served]:
    """Each target after another request computed all but its last few prompt tokens, 8 per step."""
    engine = _engine(loaded, dtype, max_num_batched_tokens=8, **kw)
    for t in targets:
        serve(engine, [t[:-5] + [1, 2, 3]], PARAMS)
    got = [serve(engine, [t], PARAMS)[0] for t in targets]
    assert engine.scheduler.kv.stats.hits_tokens > 0
    assert_no_leak(engine)
    return got


def _store_hit(loaded, dtype, targets, store: dict, reader_is_new: bool, **kw) -> list[Served]:
    """The targets once (their blocks written to the store), then each again with the device
    cache dropped, so its prefix comes from the store: in the same engine (host) or in a second
    engine on the same store (disk after the first closed, a remote pool while it lives)."""
    writer = _engine(loaded, dtype, **store, **kw)
    serve(writer, targets, PARAMS)
    writer.kv_store.store.flush()  # the writes are asynchronous
    if store.get("kv_disk_path"):
        writer.close()
    if reader_is_new:
        reader = _engine(loaded, dtype, **store, **kw)
    else:
        reader = writer
        reader.scheduler.kv.reset_prefix_cache()
    before = reader.scheduler.num_external_hit_tokens
    got = [serve(reader, [t], PARAMS)[0] for t in targets]
    assert reader.scheduler.num_external_hit_tokens - before >= 4 * len(targets), "not served from the store"
    assert_no_leak(reader)
    reader.close()
    if reader is not writer and not store.get("kv_disk_path"):
        writer.close()
    return got


def _preempted(loaded, dtype, targets, crowd, mode: str, num_blocks: int, **kw) -> list[Served]:
    engine = _engine(loaded, dtype, num_blocks=num_blocks, max_num_batched_tokens=16, preemption_mode=mode,
                     swap_space="16MiB", **kw)
    got = serve(engine, targets + crowd, PARAMS)[: len(targets)]
    assert engine.scheduler.num_preemptions >= 1, "the pool was meant to force preemption"
    assert_no_leak(engine)
    return got


def _store(tier: str, tmp_path, request) -> dict:
    if tier == "host":
        return {"kv_host_memory": "64MiB"}
    if tier == "disk":
        return {"kv_disk_path": str(tmp_path), "kv_disk_size": "64MiB"}
    service = request.getfixturevalue("redis_server" if tier == "redis" else "mooncake_master")
    if tier == "redis":
        return {"kv_remote": f"redis://127.0.0.1:{service.port}/0"}
    return {"kv_remote": f"mooncake://127.0.0.1:{service.port}?segment_mb=64&buffer_mb=32"}


@pytest.mark.parametrize("tier", ["host", "disk",
                                  pytest.param("redis", marks=pytest.mark.slow),
                                  pytest.param("mooncake", marks=pytest.mark.slow)])
def test_each_store_tier_gives_the_cold_runs_tokens_and_logprobs(bundled, tier, tmp_path, request):
    dtype, loaded = bundled
    targets, _ = _targets(loaded)
    cold = _cold(loaded, dtype, targets)
    got = _store_hit(loaded, dtype, targets, _store(tier, tmp_path, request), reader_is_new=tier != "host")
    assert got == cold, tier


def _every_path(loaded, dtype, targets, crowd, num_blocks: int, **kw) -> None:
    cold = _cold(loaded, dtype, targets, **kw)
    assert _prefix_hit(loaded, dtype, targets, **kw) == cold, "prefix hit"
    assert _store_hit(loaded, dtype, targets, {"kv_host_memory": "64MiB"}, reader_is_new=False, **kw) == cold, \
        "host store hit"
    for mode in ("recompute", "swap"):
        assert _preempted(loaded, dtype, targets, crowd, mode, num_blocks, **kw) == cold, mode


@pytest.mark.slow
def test_int8_kv_on_the_bundled_model_gives_the_cold_runs_bits_on_every_path(bundled):
    dtype, loaded = bundled
    targets, crowd = _targets(loaded)
    _every_path(loaded, dtype, targets, crowd, 16, kv_cache_dtype="int8")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sliding_window_model_gives_the_cold_runs_bits_on_every_path(gemma3_dir, dtype, kv_cache_dtype):
    """Gemma-3-like: full and windowed layer groups, prompts longer than the window, window blocks
    freed (12 blocks of 4 cannot hold the three prompts' growth: preemption)."""
    loaded = load_model(gemma3_dir, dtype=DTYPES[dtype])
    assert WINDOW in loaded.config.layer_windows and len(WINDOWED_PROMPTS[0]) > WINDOW
    targets, crowd = WINDOWED_PROMPTS[:2], WINDOWED_PROMPTS[2:]
    _every_path(loaded, dtype, targets, crowd, 12, model=str(gemma3_dir), kv_cache_dtype=kv_cache_dtype)
