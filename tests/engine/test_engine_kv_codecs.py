"""The engine over a lossy store codec: a prefix that comes back from disk or Redis quantized is
served (its blocks counted as lossy loads), and an exact engine sharing the tier never reads it."""

from __future__ import annotations

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import step_until_done
from kvpool.sched.sampling_params import SamplingParams

PROMPT = ("A lighthouse stands at the end of the long pier, and every evening its keeper climbs the "
          "ninety steps to light the lamp. ") * 4 + "Question: how many steps does the keeper climb? Answer:"


def run(engine: Engine, prompt: str):
    """The request's whole output (a step's output holds only what is new)."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return step_until_done(engine)[rid]


def make(loaded, **store) -> Engine:
    return Engine(EngineConfig(num_blocks=256, dtype="float32", cpu_weight_packing=False, **store), loaded=loaded)


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_prefix_served_through_a_lossy_codec_produces_output_and_is_counted(loaded, tmp_path, request, tier):
    if tier == "disk":
        place, name = {"kv_disk_path": str(tmp_path), "kv_disk_size": "256MiB"}, "disk"
        lossy = {"kv_disk_codec": "int4+zstd"}
    else:
        place = {"kv_remote": f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0"}
        name, lossy = "redis", {"kv_remote_codec": "int8+zstd"}
    writer = make(loaded, **place, **lossy)
    reference = run(writer, PROMPT).outputs[0].token_ids
    writer.close()  # every block saved, quantized
    reader = make(loaded, **place, **lossy)  # a fresh device cache: the prefix can only come from the tier
    out = run(reader, PROMPT)
    blocks = (len(reader.tokenizer.encode(PROMPT)) - 1) // 16
    assert out.error is None and len(out.outputs[0].token_ids) == len(reference) == 8
    assert out.num_cached_tokens == 16 * blocks and reader.kv_store.loaded_blocks == blocks
    assert reader.kv_store.store.stats()[name].lossy_loads == blocks
    reader.close()
    exact = make(loaded, **place)  # the same tier, exact codec: never sees the quantized blocks
    out = run(exact, PROMPT)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference
    exact.close()
