"""#32 items 1 and 5 together: a real `kvpool serve --record-requests` run that pins a prompt
(`POST /v1/kv/pin`), keeps another with `kvpool_retention` and churns its 32-block cache records
both, and `kvpool sim replay` of the log reproduces each request's cached tokens; without the
recorded retention and pins the replay loses them, as the server would have."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest

from kvpool.core.retention import RetentionRequest
from kvpool.engine.config import EngineConfig
from kvpool.sim.replay import load_log, replay, scheduler_config

PINNED = "The harbour master's standing orders for the quay, pinned by the operator each morning. " * 3
KEPT = "The ledger of ships that entered the harbour this season, carefully kept by the clerk. " * 3


class _StepCost:
    def step_time(self, batch) -> float:
        return 0.01

    def kv_transfer_time(self, num_blocks: int) -> float:
        return 0.0


def _complete(url: str, prompt: str, **extra) -> int:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={"prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pinned_run_is_recorded_and_replayed_with_its_hits(tmp_path: Path):
    from tests.serve.conftest import start_server

    log = tmp_path / "requests.jsonl"
    server = start_server("--num-blocks", "32", "--max-model-len", "512", "--record-requests", str(log))
    url = server.url
    try:
        r = httpx.post(f"{url}/v1/kv/pin", timeout=60, json={"prompt": PINNED, "priority": 50})
        assert r.status_code == 200, r.text
        _complete(url, PINNED)
        _complete(url, KEPT, kvpool_retention={"ttl": "1h", "priority": 3})
        for i in range(7):  # ~7 blocks each: every unretained block goes
            _complete(url, f"churn {i}: " + f"rivers, bridges and the number {i} counted slowly. " * 9)
        assert _complete(url, PINNED) >= 48 and _complete(url, KEPT) >= 48
        assert httpx.post(f"{url}/v1/kv/unpin", timeout=60, json={"prompt": PINNED}).status_code == 200
    finally:
        assert server.stop() == 0, server.log.read_text()

    recorded = load_log(log)
    requests, pins = recorded.requests, recorded.pins
    assert len(requests) == 11 and [p.retention for p in pins] == [RetentionRequest(None, None, 50), None]
    assert pins[0].block_hashes == requests[0].block_hashes == pins[1].block_hashes  # the pinned prompt's blocks
    assert requests[1].retention == (RetentionRequest(len(requests[1].block_hashes) * 16, 3600.0, 3),)
    assert "harbour" not in log.read_text()  # no text

    config = scheduler_config(EngineConfig(num_blocks=32, max_model_len=512, max_num_seqs=64), requests)
    _, run = replay(requests, config, _StepCost(), pins)
    by_arrival = sorted(run.metrics, key=lambda m: m.arrival_s)
    assert [m.cached_tokens for m in by_arrival] == [r.cached_tokens for r in requests]
    bare = [dataclasses.replace(r, retention=()) for r in requests]
    _, run = replay(bare, config, _StepCost())
    last_two = sorted(run.metrics, key=lambda m: m.arrival_s)[-2:]
    assert [m.cached_tokens for m in last_two] == [0, 0]
