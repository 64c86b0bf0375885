"""The engine over the tiered KV store: a prefix's KV from host, disk, Redis or Mooncake Store
gives the same greedy output as recomputing it, and a broken store never breaks serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.sched.sampling_params import SamplingParams

DOC = ("The museum opened in 1891 with three galleries of paintings, a hall of casts and a library. "
       "Over the next century it grew into one of the largest collections in the region. ") * 3
PROMPT = DOC + "Question: when did the museum open? Answer:"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(engine: Engine, prompt: str = PROMPT):
    rid = engine.add_request(prompt, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                result = out
    return result


@pytest.fixture(scope="module")
def reference(loaded):
    return run(Engine(EngineConfig(num_blocks=256, dtype="float32"), loaded=loaded)).outputs[0].token_ids


def make(loaded, **store) -> Engine:
    return Engine(EngineConfig(num_blocks=256, dtype="float32", **store), loaded=loaded)


def served_from_store(engine: Engine, reference) -> int:
    """Run the prompt on a device cache that does not hold it; return store-loaded tokens."""
    engine.scheduler.kv.reset_prefix_cache()
    before = engine.scheduler.num_external_hit_tokens
    out = run(engine)
    assert out.outputs[0].token_ids == reference
    return engine.scheduler.num_external_hit_tokens - before


def test_host_tier_serves_a_prefix_evicted_from_the_device(loaded, reference):
    engine = make(loaded, kv_host_memory="256MiB")
    assert run(engine).outputs[0].token_ids == reference
    hit = served_from_store(engine, reference)
    assert hit >= 112 and engine.kv_store.loaded_blocks * 16 == hit
    engine.close()


def test_restarted_engine_serves_a_repeated_prompt_from_disk(loaded, reference, tmp_path: Path):
    first = make(loaded, kv_disk_path=str(tmp_path), kv_disk_size="256MiB")
    run(first)
    first.close()  # waits for the pending writes
    second = make(loaded, kv_disk_path=str(tmp_path), kv_disk_size="256MiB")
    out = run(second)
    assert out.outputs[0].token_ids == reference and out.num_cached_tokens >= 112
    second.close()


def test_corrupt_disk_blocks_are_recomputed_and_output_stays_right(loaded, reference, tmp_path: Path, caplog):
    first = make(loaded, kv_disk_path=str(tmp_path), kv_disk_size="256MiB")
    run(first)
    first.close()
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) >= 7
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # a bit flip
    files[0].write_bytes(bytes(data))
    files[1].write_bytes(files[1].read_bytes()[:100])  # a truncated block
    second = make(loaded, kv_disk_path=str(tmp_path), kv_disk_size="256MiB")
    assert run(second).outputs[0].token_ids == reference
    second.close()


@pytest.mark.parametrize("pool", ["redis", "mooncake"])
def test_second_engine_is_served_from_the_shared_pool(loaded, reference, pool, request):
    service = request.getfixturevalue("redis_server" if pool == "redis" else "mooncake_master")
    url = (f"redis://127.0.0.1:{service.port}/0" if pool == "redis"
           else f"mooncake://127.0.0.1:{service.port}?segment_mb=64&buffer_mb=32")
    first = make(loaded, kv_remote=url)
    run(first)
    first.kv_store.store.flush()  # the writes are asynchronous
    second = make(loaded, kv_remote=url)  # (a Mooncake client's memory is part of the pool while it lives)
    out = run(second)
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens >= 112 and second.scheduler.num_external_hit_tokens >= 112
    second.close()
    first.close()


def test_a_dead_remote_pool_degrades_to_recompute(loaded, reference):
    engine = make(loaded, kv_remote="redis://127.0.0.1:9/0")  # nothing listens on the discard port
    assert run(engine).outputs[0].token_ids == reference
    assert served_from_store(engine, reference) == 0
    engine.close()
