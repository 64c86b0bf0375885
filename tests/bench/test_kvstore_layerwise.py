"""`kvpool bench kvstore --layerwise-prompt`: a smoke run on a tiny prompt (figures in docs/store.md)."""

import json

import pytest

from kvpool.bench.kvstore_layerwise import run_layerwise_bench
from kvpool.engine.config import EngineConfig


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_both_paths_serve_the_first_half_from_the_tier(tmp_path, capsys, tier):
    out = tmp_path / "layerwise.json"
    base = EngineConfig(dtype="float32", num_blocks=16, cpu_weight_packing=False)
    assert run_layerwise_bench(base, 96, 1, str(out), tier) == 0
    whole, layerwise = json.loads(out.read_text())
    assert (whole["layerwise"], layerwise["layerwise"]) == (False, True)
    assert whole["tier"] == layerwise["tier"] == tier
    assert whole["store_hit_tokens"] == layerwise["store_hit_tokens"] == 48  # the first half: 3 blocks
    assert len(whole["ttft_s"]) == len(layerwise["ttft_s"]) == 1
    assert "layer-wise / whole-block" in capsys.readouterr().out


def test_an_unknown_tier_is_refused_by_name():
    with pytest.raises(SystemExit, match="'ssd'"):
        run_layerwise_bench(EngineConfig(), 96, 1, None, "ssd")
