"""Layer-wise tier reads (issue #32 item 4): a disk hit's layer l+1 is read and checked while the
forward computes layer l; the tokens and logprobs are the cold run's; a layer that fails its check
under the forward rewinds its sequence to the failed block (core/rewind.py), which recomputes it,
while the step's other requests go on unaffected."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_engine import assert_no_leak

from kvpool.bench.determinism import greedy, random_prompts, serve
from kvpool.core.miss_reasons import INTEGRITY
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import run_to_completion, step_until_done
from kvpool.engine.loader import LoadedModel, load_model
from kvpool.store.disk import SUBDIR, file_name
from kvpool.store.format import check_head
from kvpool.store.layered import LayeredBlock

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PARAMS = greedy(12)


@pytest.fixture(scope="module", params=list(DTYPES))
def bundled(request) -> tuple[str, LoadedModel]:
    return request.param, load_model(None, dtype=DTYPES[request.param])


def _engine(loaded: LoadedModel, dtype: str, tmp_path, **kw) -> Engine:
    return Engine(EngineConfig(dtype=dtype, num_blocks=128, block_size=4, threads=1, kv_disk_path=str(tmp_path),
                               kv_disk_size="64MiB", **kw), loaded=loaded)


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    return random_prompts(np.random.default_rng(11), loaded.config.vocab_size, 2, 18, 26)


def _write(loaded, dtype, tmp_path, prompts) -> list:
    """Serve `prompts` cold, their blocks written to the disk tier; returns the cold results."""
    writer = _engine(loaded, dtype, tmp_path)
    cold = [serve(writer, [p], PARAMS)[0] for p in prompts]
    writer.close()
    return cold


def _flip_layer(reader: Engine, tmp_path, prompt: list[int], block: int, layer: int) -> None:
    """Flip a byte in the middle of layer `layer` of the prompt's block `block` on disk."""
    store = reader.kv_store.store
    h = reader.scheduler.kv.prompt_hashes(prompt)[block]
    path = tmp_path / SUBDIR / file_name(store.key(h))
    data = bytearray(path.read_bytes())
    offset, length, _ = check_head(data, len(data), store.namespace, store.block_shape, store.dtype, h).layers[layer]
    data[offset + length // 2] ^= 0x08
    path.write_bytes(bytes(data))


def _served(o) -> tuple[list[int], list[float]]:
    return o.outputs[0].token_ids, list(o.outputs[0].logprobs or [])


def _serve_layered(reader: Engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    """`prompt` alone; its store hit's blocks are staged with only their headers read."""
    rid = reader.add_request(prompt, PARAMS)
    assert reader.step() == []  # admitted: the headers are read while this step runs
    ((_, blocks),) = reader.kv_store._staged
    assert blocks and all(isinstance(b, LayeredBlock) for b in blocks)
    return _served(step_until_done(reader)[rid])


def test_a_disk_hit_read_layer_by_layer_gives_the_cold_runs_tokens_and_logprobs(bundled, tmp_path):
    dtype, loaded = bundled
    prompts = _prompts(loaded)
    cold = _write(loaded, dtype, tmp_path, prompts)
    reader = _engine(loaded, dtype, tmp_path)
    assert [_serve_layered(reader, p) for p in prompts] == cold
    assert reader.kv_store.rewound_loads == 0
    assert reader.scheduler.num_external_hit_tokens >= 4 * len(prompts)
    assert_no_leak(reader)
    reader.close()


def test_a_layer_failing_under_the_forward_rewinds_its_sequence_only(bundled, tmp_path):
    """Layer 15 of the target's block 2 is flipped on disk: its header passes, the layer fails
    while the forward runs; the target recomputes from block 2 (the cold run's tokens), the
    request beside it in the same steps is untouched, and no block leaks."""
    dtype, loaded = bundled
    target, other = _prompts(loaded)
    cold = _write(loaded, dtype, tmp_path, [target, other])
    reader = _engine(loaded, dtype, tmp_path)
    layers = loaded.config.num_layers
    _flip_layer(reader, tmp_path, target, 2, layers // 2)
    free = reader.scheduler.kv.num_free_blocks
    outs = run_to_completion(reader, [target, other], PARAMS)
    assert [_served(o) for o in outs] == cold
    connector = reader.kv_store
    assert connector.rewound_loads == 1 and connector.last_layerwise.plan.num_blocks >= 8
    sources = outs[0].metrics.prompt_sources
    blocks = (len(target) - 1) // 4
    assert sources.misses.get(INTEGRITY) == (blocks - 2) * 4 and sources.sources == {"disk": 8}
    assert outs[0].num_cached_tokens == 8
    assert INTEGRITY not in outs[1].metrics.prompt_sources.misses
    assert outs[1].num_cached_tokens == 4 * ((len(other) - 1) // 4)
    assert connector.store.stats()["disk"].bad_entries == {"checksum": 1}
    assert reader.scheduler.kv.num_free_blocks == free
    assert_no_leak(reader)
    connector.store.flush()  # the recomputed block was saved back in place of the bad one
    bad_key = connector.store.key(reader.scheduler.kv.prompt_hashes(target)[2])
    assert (tmp_path / SUBDIR / file_name(bad_key)).exists()
    reader.close()


def test_layer_l_plus_1_is_read_while_layer_l_computes(bundled, tmp_path, monkeypatch):
    """Each layer's tier read is held back until the forward has started the layer before it: a
    reader that read every layer before the forward would never get there (the gate gives up)."""
    dtype, loaded = bundled
    (prompt, _) = _prompts(loaded)
    cold = _write(loaded, dtype, tmp_path, [prompt])
    reader = _engine(loaded, dtype, tmp_path)
    connector = reader.kv_store
    real_layer = LayeredBlock.layer
    gave_up = threading.Event()

    def gated_layer(block: LayeredBlock, i: int):
        trace = connector.last_layerwise.trace
        if i > 0 and not gave_up.is_set() and not _wait_for(lambda: ("compute", i - 1) in trace):
            gave_up.set()
        if ("read", i) not in trace:
            trace.append(("read", i))
        return real_layer(block, i)

    monkeypatch.setattr(LayeredBlock, "layer", gated_layer)
    assert [_serve_layered(reader, prompt)] == cold and not gave_up.is_set()
    trace = connector.last_layerwise.trace
    at = {event: i for i, event in enumerate(trace)}
    for i in range(loaded.config.num_layers):
        assert at[("read", i)] < at[("loaded", i)] < at[("compute", i)]
        if i > 0:
            assert at[("compute", i - 1)] < at[("read", i)]  # read under the forward's layer i-1
    reader.close()


def _wait_for(condition, polls: int = 60_000) -> bool:
    """Poll `condition` every millisecond; False if it never held (a guard against a hang, not a timing)."""
    tick = threading.Event()
    for _ in range(polls):
        if condition():
            return True
        tick.wait(0.001)
    return False
