"""Request metrics, summaries, deterministic JSON, tables and plots."""

import math

import pytest

from kvpool.sim.metrics import SLO, RequestMetrics, format_table, summarize, to_json, write_json
from kvpool.sim.plots import plot_cdf, plot_lines, plot_stacked_bars


def _request(rid, arrival, times, finish=None):
    m = RequestMetrics(rid, arrival, prompt_len=10)
    for t in times:
        m.on_token(t)
    m.finish(finish if finish is not None else times[-1])
    return m


def test_per_request_latencies():
    m = _request("a", 1.0, [1.5, 1.7, 2.0, 2.5])
    assert m.ttft == pytest.approx(0.5)
    assert m.tbt == pytest.approx([0.2, 0.3, 0.5])
    assert m.tpot == pytest.approx(1.0 / 3)
    assert m.e2e == pytest.approx(1.5)
    assert m.normalized_latency == pytest.approx(1.5 / 4)


def test_summary_counts_slo_attainment_and_goodput():
    ms = [_request("fast", 0.0, [0.1, 0.2]), _request("slow", 0.0, [3.0, 4.0])]
    rejected = RequestMetrics("r", 0.0, 10, rejected=True)
    s = summarize([*ms, rejected], slo=SLO(ttft_s=1.0))
    assert (s["requests"], s["completed"], s["rejected"]) == (3, 2, 1)
    assert s["duration_s"] == pytest.approx(4.0)
    assert s["throughput_rps"] == pytest.approx(0.5)
    assert s["output_tokens_per_s"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["goodput_rps"] == pytest.approx(0.25)
    assert s["ttft_s"]["p50"] == pytest.approx(1.55)


def test_json_is_sorted_rounded_and_byte_identical(tmp_path):
    obj = {"b": 1 / 3, "a": [math.nan, 2.0000000001], "c": {"z": 1, "y": float("inf")}}
    text = to_json(obj, digits=4)
    assert text == to_json(dict(reversed(list(obj.items()))), digits=4)
    assert '"b": 0.3333' in text and "null" in text and text.index('"a"') < text.index('"b"')
    p1, p2 = write_json(tmp_path / "1.json", obj), write_json(tmp_path / "x" / "2.json", obj)
    assert p1.read_bytes() == p2.read_bytes()


def test_table_aligns_columns():
    table = format_table([{"run": "vllm", "rps": 1.23456}, {"run": "orca-max", "rps": 10.0}])
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert "1.235" in table and "orca-max" in table


def test_plots_write_png_files(tmp_path):
    png = b"\x89PNG"
    assert plot_lines([1, 2], {"a": [1, 2]}, tmp_path / "l.png", "x", "y", logy=True).read_bytes()[:4] == png
    assert plot_cdf({"a": [3, 1, 2]}, tmp_path / "c.png", "ttft").read_bytes()[:4] == png
    bars = plot_stacked_bars(["max", "pow2"], {"tokens": [1, 2], "frag": [3, 1]}, tmp_path / "b.png", "%")
    assert bars.read_bytes()[:4] == png
