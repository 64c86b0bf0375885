"""`kvpool sim scale` end to end on the first requests of the conversation trace (the full
trace is the benchmark; its wall time is reported, never asserted)."""

import gc
import json

from kvpool.cli import main


def test_scale_command_writes_its_figures_and_is_deterministic(tmp_path, capsys):
    runs = []
    for out in (tmp_path / "a", tmp_path / "b"):
        assert main(["sim", "scale", "--max-requests", "120", "--out", str(out)]) == 0
        runs.append(json.loads((out / "scale.json").read_text()))
    first = runs[0]
    assert first["requests"] == 120
    assert first["completed"] + first["rejected"] == 120 and first["completed"] > 0
    assert first["wall_s"] > 0 and first["simulated_requests_per_s"] > 0
    assert 0 < first["prefix_hit_rate"] < 1  # the conversation trace reuses earlier turns
    timing = ("wall_s", "simulated_requests_per_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in runs][0] == \
        {k: v for k, v in runs[1].items() if k not in timing}
    assert "simulated_requests_per_s" in capsys.readouterr().out
    assert gc.isenabled()  # the command pauses the collector only for its run


def test_scale_repeat_runs_the_trace_again_in_a_row(tmp_path):
    assert main(["sim", "scale", "--max-requests", "60", "--repeat", "2", "--out", str(tmp_path)]) == 0
    twice = json.loads((tmp_path / "scale.json").read_text())
    assert twice["requests"] == 120 and twice["completed"] + twice["rejected"] == 120
    assert twice["virtual_s"] > 2 * 60 / 3.4  # the second copy arrives after the first (~3.4 req/s)
