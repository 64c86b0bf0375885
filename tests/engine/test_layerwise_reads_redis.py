"""Layer-wise tier reads from Redis (issue #32 item 4): a Redis hit has only its block headers read
before the step (GETRANGE), each layer read and checked under the forward; the tokens and logprobs
are the cold run's; a byte flipped in one layer of a Redis value fails that layer under the
forward, its sequence recomputes from the bad block (an `integrity` miss) and gives the cold tokens."""

from __future__ import annotations

import pytest
import redis
from test_engine import assert_no_leak
from test_layerwise_reads import DTYPES, PARAMS, _prompts, _served

from kvpool.bench.determinism import serve
from kvpool.core.miss_reasons import INTEGRITY
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import run_to_completion, step_until_done
from kvpool.engine.loader import LoadedModel, load_model
from kvpool.store.format import check_head
from kvpool.store.layered import LayeredBlock

DB = 6  # this file's database on the session's redis-server, emptied per test (a cold run finds nothing)


@pytest.fixture(scope="module", params=["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def bundled(request) -> tuple[str, LoadedModel]:
    return request.param, load_model(None, dtype=DTYPES[request.param])


@pytest.fixture
def pool(redis_server):
    redis.Redis(port=redis_server.port, db=DB).flushdb()
    return redis_server


def _engine(loaded: LoadedModel, dtype: str, port: int) -> Engine:
    return Engine(EngineConfig(dtype=dtype, num_blocks=128, block_size=4, threads=1,
                               kv_remote=f"redis://127.0.0.1:{port}/{DB}", kv_layerwise_remote_reads=True),
                  loaded=loaded)


def _write(loaded, dtype, port, prompts) -> list:
    """Serve `prompts` cold, their blocks written to Redis; returns the cold results."""
    writer = _engine(loaded, dtype, port)
    cold = [serve(writer, [p], PARAMS)[0] for p in prompts]
    writer.close()
    return cold


def test_a_redis_hit_read_layer_by_layer_gives_the_cold_runs_tokens_and_logprobs(bundled, pool):
    dtype, loaded = bundled
    prompts = _prompts(loaded)
    cold = _write(loaded, dtype, pool.port, prompts)
    reader = _engine(loaded, dtype, pool.port)
    got = []
    for prompt in prompts:
        rid = reader.add_request(prompt, PARAMS)
        assert reader.step() == []  # admitted: only the headers are read while this step runs
        ((_, blocks),) = reader.kv_store._staged
        assert blocks and all(isinstance(b, LayeredBlock) and b.tier == "redis" for b in blocks)
        got.append(_served(step_until_done(reader)[rid]))
    assert got == cold
    assert reader.kv_store.rewound_loads == 0
    assert reader.scheduler.num_external_hit_tokens >= 4 * len(prompts)
    assert_no_leak(reader)
    reader.close()


def test_a_flipped_layer_in_a_redis_value_rewinds_to_the_cold_tokens(bundled, pool):
    dtype, loaded = bundled
    target, other = _prompts(loaded)
    cold = _write(loaded, dtype, pool.port, [target, other])
    reader = _engine(loaded, dtype, pool.port)
    store = reader.kv_store.store
    block_hash = reader.scheduler.kv.prompt_hashes(target)[2]
    key = store.key(block_hash)
    r = redis.Redis(port=pool.port, db=DB)
    value = r.get(key)
    offset, length, _ = check_head(value, len(value), store.namespace, store.block_shape, store.dtype,
                                   block_hash).layers[loaded.config.num_layers // 2]
    r.setrange(key, offset + length // 2, bytes([value[offset + length // 2] ^ 0x08]))
    outs = run_to_completion(reader, [target, other], PARAMS)
    assert [_served(o) for o in outs] == cold
    assert reader.kv_store.rewound_loads == 1
    blocks = (len(target) - 1) // 4
    assert outs[0].metrics.prompt_sources.misses.get(INTEGRITY) == (blocks - 2) * 4
    assert outs[0].metrics.prompt_sources.sources == {"redis": 8}
    assert INTEGRITY not in outs[1].metrics.prompt_sources.misses
    assert store.stats()["redis"].bad_entries == {"checksum": 1}
    assert_no_leak(reader)
    reader.close()
