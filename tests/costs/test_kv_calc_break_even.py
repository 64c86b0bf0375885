"""`kvpool kv calc` asks the engine's load-or-recompute planner per tier: a tier at or above its
break-even bandwidth is loaded whole, one below is not, and GQA breaks even on slower tiers."""

import json
from types import SimpleNamespace

import pytest

from kvpool.costs.kv_calc import break_even_table, format_break_even
from kvpool.costs.presets import HARDWARE, MODELS
from kvpool.errors import ConfigError
from kvpool.store.cli import main

A100 = HARDWARE["a100-80gb"]


def test_a_tier_loads_the_whole_prefix_exactly_above_its_break_even():
    for row in break_even_table(MODELS["llama2-7b"], A100, [512, 4096]):
        if row.break_even_bandwidth is None:
            assert row.loaded_blocks < row.blocks
        else:
            assert (row.loaded_blocks == row.blocks) == (row.bandwidth >= row.break_even_bandwidth)


def test_gqa_breaks_even_on_a_slower_tier_than_mha():
    (gqa,) = [r for r in break_even_table(MODELS["llama2-70b"], A100, [2048]) if r.tier == "disk"]
    (mha,) = [r for r in break_even_table(MODELS["opt-13b"], A100, [2048]) if r.tier == "disk"]
    assert gqa.break_even_bandwidth < mha.break_even_bandwidth / 4


def test_the_table_and_the_cli_print_every_tier(tmp_path, capsys):
    rows = break_even_table(MODELS["opt-13b"], A100, [512])
    assert [r.tier for r in rows] == ["host", "disk", "remote"]
    assert len(format_break_even(rows).splitlines()) == 4
    out = tmp_path / "calc.json"
    assert main(SimpleNamespace(hardware="a100-80gb", model=["opt-13b"], context=[512], mfu=0.5, block_size=16,
                                json=str(out))) == 0
    assert "break-even" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["break_even"]) == 3
    with pytest.raises(ConfigError, match="8"):
        break_even_table(MODELS["opt-13b"], A100, [8])
