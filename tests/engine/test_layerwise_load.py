"""Layer-wise loading of store hits (issue 16 item 2): the forward computes layer l once layer l's
KV has landed, the outputs equal the whole-block path's, and a block that fails to load in the
middle of a prefix is recomputed on both paths alike."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvpool.engine.config import EngineConfig, add_engine_args, engine_config_from_args
from kvpool.engine.engine import Engine
from kvpool.sched.sampling_params import SamplingParams
from kvpool.store.disk import SUBDIR

TEXT = ("The observatory on the hill was built in 1887 to time the ships leaving the harbour. Its "
        "dome turned on cannon balls and its clock set the noon gun for the whole town. ") * 3
PROMPT = TEXT + "Question: what did the observatory's clock set? Answer:"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DAMAGED = 4  # the block, counted from the prompt's first, that fails to load


def run(engine: Engine, prompt: str = PROMPT):
    rid = engine.add_request(prompt, GREEDY)
    result = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                result = out
    return result


def make(loaded, layerwise: bool, **store) -> Engine:
    # The reference engine packed the shared model's weights already; skipping the per-engine
    # kernel warm-up keeps each of this file's many engines cheap (same weights, same kernels).
    return Engine(EngineConfig(num_blocks=256, dtype="float32", kv_layerwise_load=layerwise,
                               cpu_weight_packing=False, **store), loaded=loaded)


@pytest.fixture(scope="module")
def reference(loaded):
    return run(Engine(EngineConfig(num_blocks=256, dtype="float32"), loaded=loaded)).outputs[0].token_ids


def block_keys(engine: Engine) -> list[str]:
    hashes = engine.scheduler.kv.prompt_hashes(engine.tokenizer.encode(PROMPT))
    return [engine.kv_store.store.key(h) for h in hashes]


def serve_from_store(engine: Engine):
    """PROMPT with its device copy dropped: its prefix comes from the store (or is recomputed)."""
    engine.scheduler.kv.reset_prefix_cache()
    out = run(engine)
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    return out


class DiskPool:
    def __init__(self, path: Path) -> None:
        self.path = path

    def options(self) -> dict:
        return {"kv_disk_path": str(self.path), "kv_disk_size": "256MiB"}

    def damage(self, key: str, how: str) -> None:
        f = self.path / SUBDIR / (key.encode().hex() + ".kvb")
        if how == "missing":
            f.unlink(missing_ok=True)
        else:
            data = bytearray(self.saved[key])
            data[len(data) // 2] ^= 0x10  # a bit flip in the middle of the payload
            f.write_bytes(bytes(data))

    def remember(self, keys: list[str]) -> None:
        self.saved = {k: (self.path / SUBDIR / (k.encode().hex() + ".kvb")).read_bytes() for k in keys}


class RedisPool:
    def __init__(self, port: int) -> None:
        import redis

        self.raw = redis.Redis(port=port)
        self.port = port

    def options(self) -> dict:
        return {"kv_remote": f"redis://127.0.0.1:{self.port}/0"}

    def damage(self, key: str, how: str) -> None:
        if how == "missing":
            self.raw.delete(key)
        else:
            data = bytearray(self.saved[key])
            data[len(data) // 2] ^= 0x10
            self.raw.set(key, bytes(data))

    def remember(self, keys: list[str]) -> None:
        self.saved = {k: self.raw.get(k) for k in keys}


@pytest.mark.parametrize("damage", ["intact", "corrupted", "missing"])
@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_layerwise_output_equals_whole_block_output(loaded, reference, tmp_path, request, tier, damage):
    pool = DiskPool(tmp_path) if tier == "disk" else RedisPool(request.getfixturevalue("redis_server").port)
    writer = make(loaded, False, **pool.options())
    assert run(writer).outputs[0].token_ids == reference
    writer.close()  # every block saved
    keys = block_keys(writer)
    assert len(keys) > DAMAGED + 2
    pool.remember(keys)
    whole = (len(writer.tokenizer.encode(PROMPT)) - 1) // 16
    expected = DAMAGED if damage != "intact" else whole
    # disk reads layer by layer (Redis only with --kv-layerwise-remote-reads): a flipped payload byte
    # passes the header and fails under the forward
    rewound = tier == "disk" and damage == "corrupted"
    results = {}
    for layerwise in (False, True):
        if damage != "intact":  # again: the first run recomputed the block and saved it back
            pool.damage(keys[DAMAGED], damage)
        engine = make(loaded, layerwise, **pool.options())
        out = serve_from_store(engine)
        results[layerwise] = (out.outputs[0].token_ids, out.num_cached_tokens, engine.kv_store.loaded_blocks)
        used = engine.kv_store.last_layerwise
        rewinds = engine.kv_store.rewound_loads
        engine.close()
        if layerwise:
            assert used is not None and used.plan.num_blocks == (whole if rewound else expected)
            assert rewinds == rewound
        else:
            assert used is None
    assert results[True] == results[False]
    assert results[True] == (reference, 16 * expected, expected)


def test_layer_l_computes_before_layer_l_plus_1_has_loaded(loaded, reference, tmp_path, monkeypatch):
    """The loader holds back layer l+1 until the forward has started layer l: a forward that
    waited for every layer first would never get there (the gate gives up and the test fails)."""
    engine = make(loaded, True, kv_host_memory="256MiB")
    run(engine)
    engine.kv_store.store.flush()
    connector = engine.kv_store
    real_write = connector._write_layer
    gave_up = threading.Event()

    def gated_write(layer, ids, blocks):
        trace = connector.last_layerwise.trace
        if layer > 0:
            waited = 0
            while ("compute", layer - 1) not in trace:
                if waited > 60_000:
                    gave_up.set()
                    break
                threading.Event().wait(0.001)
                waited += 1
        real_write(layer, ids, blocks)

    monkeypatch.setattr(connector, "_write_layer", gated_write)
    out = serve_from_store(engine)
    assert out.outputs[0].token_ids == reference and not gave_up.is_set()
    trace = connector.last_layerwise.trace
    layers = engine.loaded.config.num_layers
    assert sorted(trace) == sorted([("loaded", i) for i in range(layers)] + [("compute", i) for i in range(layers)])
    at = {event: i for i, event in enumerate(trace)}
    for i in range(layers):
        assert at[("loaded", i)] < at[("compute", i)]  # never computes a layer before its KV landed
        if i + 1 < layers:
            assert at[("compute", i)] < at[("loaded", i + 1)]  # layer i computed while i+1 still loading
    engine.close()


def test_a_load_aborted_before_its_first_step_writes_nothing(loaded, tmp_path):
    engine = make(loaded, True, kv_host_memory="256MiB")
    run(engine)
    engine.kv_store.store.flush()
    engine.scheduler.kv.reset_prefix_cache()
    rid = engine.add_request(PROMPT, GREEDY)
    assert engine.step() == []  # admitted; its load lands after this (empty) step, and is reported
    assert engine.kv_store._staged  # read and checked, not yet written
    engine.abort(rid)
    assert run(engine, "Another prompt entirely, unrelated to the first one.").finished
    assert engine.kv_store.last_layerwise is None  # its blocks were no longer its own: not written
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    engine.close()


def test_the_flag_turns_layerwise_loading_off():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).kv_layerwise_load is True
    assert engine_config_from_args(parser.parse_args(["--no-kv-layerwise-load"])).kv_layerwise_load is False
    # remote pools are read whole before the step unless asked (a round trip per block and layer)
    assert engine_config_from_args(parser.parse_args([])).kv_layerwise_remote_reads is False
    assert engine_config_from_args(parser.parse_args(["--kv-layerwise-remote-reads"])).kv_layerwise_remote_reads


def test_a_group_swapped_out_before_its_first_step_takes_its_store_kv_along(loaded, reference):
    """Between the load's report and its first forward the group is preempted by swapping: its
    blocks must reach the host holding the store's KV, not the unwritten device blocks."""
    import numpy as np
    import torch

    from kvpool.core.block_pool import KVEvents
    from kvpool.sched.output import SchedulerOutput

    engine = make(loaded, True, kv_host_memory="256MiB", preemption_mode="swap", swap_space="64MiB")
    run(engine)
    engine.kv_store.store.flush()
    engine.scheduler.kv.reset_prefix_cache()
    engine.add_request(PROMPT, GREEDY)
    assert engine.step() == []
    ((load, blocks),) = engine.kv_store._staged
    sched = engine.scheduler
    out = SchedulerOutput()
    sched.running.remove(load.group)
    sched.preemption.preempt(load.group, out)  # as a decode step short of blocks would
    assert out.swap_out
    engine.kv_store.before_forward(out, KVEvents())
    engine.runner._move_blocks(out)
    engine.kv_store.after_forward(False)
    host = [dict(out.swap_out)[b] for b in load.block_ids[: len(blocks)]]
    k_host = engine.runner.host_caches[3][0]
    assert torch.equal(k_host[host], torch.from_numpy(np.stack([b[3, 0] for b in blocks])))
    result = None
    while engine.has_unfinished():
        for o in engine.step():
            result = o
    assert result.outputs[0].token_ids == reference
    engine.close()


def test_a_quantized_hit_is_decoded_under_the_forward_and_equals_the_whole_block_path(loaded, tmp_path):
    """int4 blocks have their header checked before the step and are read, checked and dequantized
    layer by layer by the loader; both paths write the same dequantized KV."""
    from kvpool.store.layered import LayeredBlock

    opts = {"kv_disk_path": str(tmp_path), "kv_disk_size": "256MiB", "kv_disk_codec": "int4"}
    writer = make(loaded, False, **opts)
    run(writer)
    writer.close()
    results = {}
    for layerwise in (False, True):
        engine = make(loaded, layerwise, **opts)
        rid = engine.add_request(PROMPT, GREEDY)
        assert engine.step() == []  # admitted; the load lands after this (empty) step
        if layerwise:
            ((_, blocks),) = engine.kv_store._staged
            assert blocks and all(isinstance(b, LayeredBlock) for b in blocks)  # headers checked, layers unread
        out = None
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished and o.request_id == rid:
                    out = o
        results[layerwise] = (out.outputs[0].token_ids, out.num_cached_tokens)
        engine.close()
    assert results[True] == results[False] and results[True][1] > 0
