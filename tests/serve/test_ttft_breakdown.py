"""A real `kvpool serve`'s TTFT breakdown (`kvpool:ttft_breakdown_seconds{phase}`): every phase is
observed once per engine request, streamed or not, completion or chat; the phases of a request
sum to at most the TTFT its client measured, the engine's share to at most the server's own
TTFT histogram; and `kvpool bench serve` prints the breakdown of its run."""

from __future__ import annotations

import argparse
import json
import time

import httpx
import pytest
from conftest import Server, start_server
from prometheus_client.parser import text_string_to_metric_families

from kvpool.bench.serve import add_arguments, main
from kvpool.bench.serve_metrics import bucket_quantile
from kvpool.serve.metrics import TTFT_PHASES

pytestmark = pytest.mark.timeout(1200)  # a server's start and a few requests on a shared 2-core machine

FRONT = ("receive", "deliver")  # outside the server's TTFT histogram (arrival to the token's step)
IN_PREFILL = ("prefill_compute", "sample", "postprocess", "detokenize")  # inside first scheduled -> token


@pytest.fixture(scope="module")
def server():
    s = start_server()
    yield s
    assert s.stop() == 0, s.log.read_text()


def scrape(server: Server) -> dict[str, float]:
    """Sums and counts: `phase:NAME:sum|count` per phase, and `NAME_sum` of the other histograms."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            if s.name.endswith(("_sum", "_count")):
                key = (f"phase:{s.labels['phase']}:{s.name.rsplit('_', 1)[1]}"
                       if family.name == "kvpool:ttft_breakdown_seconds" else s.name)
                out[key] = out.get(key, 0.0) + s.value
    return out


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def model(server: Server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def timed_request(server: Server, route: str, body: dict) -> float:
    """The client's TTFT: send to the first chunk with text (the whole response if not streamed)."""
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{server.url}{route}", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text") or choices[0].get("delta", {}).get("content"):
                    first = time.perf_counter()
    return (first if first is not None else time.perf_counter()) - start


@pytest.mark.parametrize(("route", "extra", "requests"), [
    ("/v1/completions", {"prompt": "The lighthouse keeper counted the ships", "stream": True}, 1),
    ("/v1/completions", {"prompt": list(range(1000, 1100)), "stream": True}, 1),
    ("/v1/completions", {"prompt": "A whole answer, not streamed"}, 1),
    ("/v1/completions", {"prompt": ["First of two prompts", "Second of two"], "stream": True}, 2),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}], "stream": True}, 1),
])
def test_each_phase_once_per_request_and_the_phases_fit_in_its_ttft(server, route, extra, requests):
    before = scrape(server)
    client_ttft = timed_request(server, route, {"model": model(server), "max_tokens": 3, "temperature": 0,
                                                "ignore_eos": True, **extra})
    after = scrape(server)
    phases = {p: delta(before, after, f"phase:{p}:sum") for p in TTFT_PHASES}
    for p in TTFT_PHASES:
        assert delta(before, after, f"phase:{p}:count") == requests, p
        assert phases[p] >= 0, p
    assert phases["prefill_compute"] > 0
    assert delta(before, after, "kvpool:time_to_first_token_seconds_count") == requests
    if requests == 1:  # one request: its phases against its own TTFT
        assert sum(phases.values()) <= client_ttft
    assert sum(v for p, v in phases.items() if p not in FRONT) <= delta(
        before, after, "kvpool:time_to_first_token_seconds_sum")
    assert sum(phases[p] for p in IN_PREFILL) <= delta(before, after, "kvpool:request_prefill_time_seconds_sum")
    queue_time = delta(before, after, "kvpool:request_queue_time_seconds_sum")  # vLLM's: taken -> first scheduled
    assert phases["queue"] <= queue_time <= phases["queue"] + phases["schedule"] + 1e-6


def test_bench_serve_prints_the_runs_breakdown(server, capsys, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "result.json"
    args = parser.parse_args(["--base-url", server.url, "--num-prompts", "3", "--random-input-len", "16",
                              "--random-output-len", "3", "--no-progress", "--save-result", str(out)])
    assert main(args) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("TTFT breakdown"):]
    for p in TTFT_PHASES:
        assert f"\n{p} " in table, p
    breakdown = json.loads(out.read_text())["ttft_breakdown"]
    assert list(breakdown) == list(TTFT_PHASES)  # in the order a request meets them
    assert all(row["count"] == 3 for row in breakdown.values())
    assert all(0 <= row["p50_ms"] <= row["p99_ms"] for row in breakdown.values())


def test_quantiles_read_buckets_as_prometheus_does():
    buckets = [(0.1, 2.0), (0.2, 4.0), (float("inf"), 4.0)]
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1)
    assert bucket_quantile(0.75, buckets) == pytest.approx(0.15)  # halfway into the second bucket
    assert bucket_quantile(0.99, [(0.1, 1.0), (float("inf"), 2.0)]) == pytest.approx(0.1)  # the +Inf bucket
