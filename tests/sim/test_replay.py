"""`kvpool sim replay`: a real server's request log through the simulator. The log's hashes keep
exactly the server's sharing (equal prefixes, tenants apart), bad logs are refused by line, and a
short recorded run replayed at its recorded configuration, with step times fitted to this
machine, reproduces the recorded hit rate within 2 points and mean TTFT within 15%."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvpool.errors import ConfigError
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.replay import Recorded, load_record, recorded_summary, replay, replay_requests
from kvpool.sim.tokens import BlockHasher, TokenSynth


def line(**over) -> str:
    rec = {"v": 1, "arrival_s": 1.0, "block_size": 4, "block_hashes": ["aa", "bb"], "prompt_len": 9,
           "output_len": 3, "cached_tokens": 0, "ttft_s": 0.1, "scope": None}
    return json.dumps({**rec, **over})


def test_equal_recorded_hashes_are_equal_prefixes_in_the_simulator(tmp_path: Path):
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join([
        line(arrival_s=5.0, block_hashes=["a0", "a1", "a2"], prompt_len=14),
        line(arrival_s=5.5, block_hashes=["a0", "a1", "b2"], prompt_len=12),  # shares 2 blocks
        line(arrival_s=6.0, block_hashes=["c0"], prompt_len=4, scope="t2"),  # another tenant: nothing shared
    ]) + "\n")
    records = load_record(log)
    reqs = replay_requests(records)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0]
    assert [r.prompt_len for r in reqs] == [14, 12, 4] and sum(n for _, n in reqs[0].chunks) == 14
    hashes = [BlockHasher(4, TokenSynth()).hashes(r.chunks) for r in reqs]
    assert hashes[0][:2] == hashes[1][:2] and hashes[0][2] != hashes[1][2]
    assert not set(hashes[2]) & set(hashes[0] + hashes[1])
    run_summary, _ = replay(records, SchedulerConfig(num_blocks=64, block_size=4), _FixedCost())
    assert run_summary["requests"] == 3
    assert run_summary["prefix_hit_rate"] == pytest.approx(8 / 30)  # the second request reuses 2 blocks


class _FixedCost:
    def step_time(self, batch) -> float:
        return 0.01

    def kv_transfer_time(self, num_blocks: int) -> float:
        return 0.0


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "log.jsonl:1: not JSON"),
    (line(v=2), "log.jsonl:1: not a version-1"),
    (json.dumps({"v": 1, "arrival_s": 0}), "log.jsonl:1: record lacks"),
    (line(block_hashes=["a", "b", "c"]), "3 block hashes of 4 tokens for a prompt of 9"),
    ("", "holds no request"),
])
def test_a_bad_log_is_refused_by_line(tmp_path: Path, text: str, message: str):
    log = tmp_path / "log.jsonl"
    log.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_record(log)


def test_the_cli_refuses_what_it_cannot_replay(tmp_path: Path, capsys):
    from kvpool.cli import main

    log = tmp_path / "log.jsonl"
    log.write_text(line() + "\n")
    assert main(["sim", "replay", str(log)]) == 2
    assert "--num-blocks" in capsys.readouterr().err
    assert main(["sim", "replay", str(log), "--num-blocks", "64", "--kv-host-memory", "1GiB"]) == 2
    assert "--kv-host-memory is not simulated" in capsys.readouterr().err
    out = tmp_path / "cmp.json"
    assert main(["sim", "replay", str(log), "--num-blocks", "64", "--block-size", "4", "--out", str(out)]) == 0
    assert "prefix_hit_rate" in capsys.readouterr().out and json.loads(out.read_text())["replayed"]["requests"] == 1


SYSTEMS = [f"You are assistant number {k}. Answer briefly and politely, citing the manual section. " * 4
           for k in range(4)]
SERVER = ["--num-blocks", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "512"]


def _send(url: str, model: str, prompt: str, at: float, t0: float, errors: list) -> None:
    time.sleep(max(0.0, t0 + at - time.monotonic()))
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": 8, "min_tokens": 8, "temperature": 0, "ignore_eos": True})
        if r.status_code != 200:
            errors.append(r.text)
    except httpx.HTTPError as e:
        errors.append(repr(e))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a server start, 20 requests, an engine load and a profile
def test_replay_at_the_recorded_configuration_reproduces_the_server(tmp_path: Path):
    from kvpool.bench.profile import run_profile
    from kvpool.costs.cost_model import MeasuredCostModel
    from kvpool.engine.config import EngineConfig
    from tests.serve.conftest import start_server

    log = tmp_path / "requests.jsonl"
    server = start_server(*SERVER, "--record-requests", str(log))
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    rng = random.Random(7)
    t0, errors, threads, at = time.monotonic() + 0.5, [], [], 0.0
    for i in range(20):  # 4 system prompts shared by 5 requests each, Poisson arrivals at ~2/s
        prompt = SYSTEMS[i % 4] + f"Question {i}: " + " ".join(rng.choice(["why", "how", "when", "what"])
                                                               for _ in range(5 + i % 7))
        threads.append(threading.Thread(target=_send, args=(server.url, model, prompt, at, t0, errors)))
        at += rng.expovariate(2.0)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert server.stop() == 0, server.log.read_text()
    assert not errors, errors
    records = load_record(log)
    assert len(records) == 20 and all(isinstance(r, Recorded) for r in records)

    # step times fitted to this machine: the same engine configuration, profiled just after
    profile = run_profile(EngineConfig(dtype="float32", num_blocks=256, max_num_seqs=16, max_num_batched_tokens=512,
                                       max_model_len=1024), "tiny")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    config = SchedulerConfig(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                             max_model_len=1024)
    recorded = recorded_summary(records)
    replayed, _ = replay(records, config, MeasuredCostModel.from_profile(path))
    print(json.dumps({"recorded": recorded, "replayed": replayed}))
    assert recorded["prefix_hit_rate"] > 0.4  # the shared system prompts are reused
    assert abs(replayed["prefix_hit_rate"] - recorded["prefix_hit_rate"]) <= 0.02
    assert abs(replayed["ttft_mean_s"] - recorded["ttft_mean_s"]) <= 0.15 * recorded["ttft_mean_s"]
