"""`kvpool bench kvstore --layerwise-prompt`: a smoke run on a tiny prompt (figures in docs/store.md)."""

import json

from kvpool.bench.kvstore_layerwise import run_layerwise_bench
from kvpool.engine.config import EngineConfig


def test_both_paths_serve_the_first_half_from_disk(tmp_path, capsys):
    out = tmp_path / "layerwise.json"
    base = EngineConfig(dtype="float32", num_blocks=16, cpu_weight_packing=False)
    assert run_layerwise_bench(base, 96, 1, str(out)) == 0
    whole, layerwise = json.loads(out.read_text())
    assert (whole["layerwise"], layerwise["layerwise"]) == (False, True)
    assert whole["store_hit_tokens"] == layerwise["store_hit_tokens"] == 48  # the first half: 3 blocks
    assert len(whole["ttft_s"]) == len(layerwise["ttft_s"]) == 1
    assert "layer-wise / whole-block" in capsys.readouterr().out
