"""`kvpool bench serve` reads its prompt vocabulary from the server, no --vocab-size needed."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import httpx
import pytest
from conftest import API_KEY, AUTH, Server, start_server

from kvpool.bench.serve import add_arguments, main, probe_text, server_token_ids
from kvpool.errors import ConfigError


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--api-key", API_KEY, "--no-cpu-weight-packing", headers=AUTH)  # packing is not under test
    yield s
    assert s.stop() == 0, s.log.read_text()


def test_token_ids_are_the_servers_own(server):
    model_id = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    ids = server_token_ids(server.url, model_id, AUTH)
    assert len(ids) > 1000
    assert all(0 <= i < 49152 for i in ids)
    assert probe_text() == probe_text()  # the same ids every run


def test_bench_serve_runs_against_the_server_without_vocab_size(server, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "3",
                              "--random-input-len", "16", "--random-output-len", "4", "--no-progress"])
    assert args.vocab_size is None
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Successful requests" in out and "HTTP Request" not in out


def test_warm_up_requests_are_sent_but_not_counted(server, tmp_path):
    """The client's own start-up is paid by untimed requests before the run's counters are read:
    the server sees them, the run's figures (and the server-side TTFT breakdown) do not."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    result = tmp_path / "r.json"
    args = parser.parse_args(["--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "3",
                              "--random-input-len", "16", "--random-output-len", "2", "--no-progress",
                              "--warmup-requests", "2", "--save-result", str(result)])
    before = _finished(server)
    assert main(args) == 0
    assert _finished(server) - before == 5  # three timed, two warm-ups
    summary = json.loads(result.read_text())
    assert summary["completed"] == 3
    assert summary["ttft_breakdown"]["receive"]["count"] == 3


def test_negative_warm_up_count_is_refused(server):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--base-url", server.url, "--api-key", API_KEY, "--warmup-requests", "-1"])
    with pytest.raises(ConfigError, match="--warmup-requests"):
        main(args)


def _finished(server: Server) -> float:
    """Requests the server has finished, from its Prometheus counters."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvpool:request_success_total"))
