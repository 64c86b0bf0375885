"""`kvpool bench kvstore --layerwise-prompt`: a smoke run on a tiny prompt (figures in docs/store.md)."""

import json

import pytest

from kvpool.bench.kvstore_layerwise import run_layerwise_bench
from kvpool.engine.config import EngineConfig


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_every_path_serves_the_first_half_from_the_tier(tmp_path, capsys, tier):
    out = tmp_path / "layerwise.json"
    base = EngineConfig(dtype="float32", num_blocks=16, cpu_weight_packing=False)
    assert run_layerwise_bench(base, 96, 1, str(out), tier) == 0
    results = json.loads(out.read_text())
    # both tiers read ranges (disk: pread, Redis: GETRANGE), so both run the layer-wise read path
    assert [r["path"] for r in results] == ["whole-block", "layer-wise write", "layer-wise read"]
    assert all(r["tier"] == tier for r in results)
    assert all(r["store_hit_tokens"] == 48 for r in results)  # the first half: 3 blocks
    assert all(len(r["ttft_s"]) == 1 for r in results)
    assert "TTFT / whole-block: layer-wise write" in capsys.readouterr().out


def test_an_unknown_tier_is_refused_by_name():
    with pytest.raises(SystemExit, match="'ssd'"):
        run_layerwise_bench(EngineConfig(), 96, 1, None, "ssd")
