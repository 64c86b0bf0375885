"""A real `kvpool serve` with a disk tier: every response's usage splits its prompt tokens into
sources and miss reasons that sum to prompt_tokens, /metrics counts them by source and reason,
and `--record-requests` writes one line per request (hashes and lengths, no text). Each reason
comes from what really causes it: a repeat (device hit), another salt, a device reset (disk hit),
corrupted disk blocks (integrity), a disk tier too small to keep the prompt (evicted from it)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx
import pytest
from conftest import Server, start_server

from kvpool.bench.serve import add_arguments, main
from kvpool.store.disk import SUBDIR

pytestmark = pytest.mark.timeout(1200)  # a disk server's start and ten requests on a shared 2-core machine

P1 = "The museum opened in 1891 with three galleries of paintings, a hall of casts and a library. " * 3
P2 = "Rivers carry sediment from the mountains to the sea, building deltas over the centuries. " * 45


@pytest.fixture(scope="module")
def disk_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("miss")
    record = root / "requests.jsonl"
    s = start_server("--kv-disk-path", str(root / "disk"), "--kv-disk-size", "16MiB", "--record-requests", str(record))
    yield s, root / "disk" / SUBDIR, record
    assert s.stop() == 0, s.log.read_text()


def complete(server: Server, prompt: str, **extra) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=300,
                   json={"model": served_model(server), "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    details = usage["prompt_tokens_details"]
    sources, misses = details["kvpool_sources"], details["kvpool_miss_reasons"]
    assert sum(sources.values()) + sum(misses.values()) == usage["prompt_tokens"]
    assert sum(sources.values()) == details["cached_tokens"]
    return {"sources": sources, "misses": misses, "prompt_tokens": usage["prompt_tokens"]}


def served_model(server: Server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def reset_device(server: Server) -> None:
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200


def counters(server: Server) -> dict[tuple[str, str], float]:
    """The breakdown counters of /metrics: (name, label value) -> value."""
    out = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        for name, label in (("prompt_tokens_by_kv_source_total", "source"), ("prompt_tokens_missed_total", "reason")):
            if line.startswith(f"kvpool:{name}{{"):
                value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                out[(name, value)] = float(line.rsplit(" ", 1)[1])
    return out


def test_every_prompt_token_has_a_source_or_a_reason(disk_server):
    server, disk, record = disk_server
    first = complete(server, P1)
    full = (first["prompt_tokens"] - 1) // 16 * 16  # the blocks a hit can reach
    assert first["sources"] == {} and first["misses"]["first_seen"] == full
    assert complete(server, P1)["sources"] == {"device": full}

    before = counters(server)
    salted = complete(server, P1, cache_salt="another-tenant")
    assert salted["sources"] == {} and salted["misses"]["first_seen"] == full  # usage tells no other tenant's secret
    after = counters(server)
    assert after[("prompt_tokens_missed_total", "different_salt")] - before.get(
        ("prompt_tokens_missed_total", "different_salt"), 0) == full  # the operator's view does

    reset_device(server)
    assert complete(server, P1)["sources"] == {"disk": full}

    reset_device(server)
    for f in disk.glob("*.kvb"):  # every block on disk fails its check now
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    bad = complete(server, P1)
    assert bad["sources"] == {} and bad["misses"]["integrity"] == full

    complete(server, P2)  # 16 MiB of disk holds ~22 blocks: P2's ~48 push P1's out
    reset_device(server)
    gone = complete(server, P1)
    assert gone["sources"] == {} and gone["misses"]["evicted_disk"] == full

    totals = counters(server)
    for key in (("prompt_tokens_by_kv_source_total", "device"), ("prompt_tokens_by_kv_source_total", "disk"),
                ("prompt_tokens_missed_total", "integrity"), ("prompt_tokens_missed_total", "evicted_disk")):
        assert totals[key] >= full, key
    assert totals[("prompt_tokens_missed_total", "partial_block")] >= 8 * (first["prompt_tokens"] - full)

    deadline = time.monotonic() + 30  # the engine thread records a request after its response left
    while len(Path(record).read_text().splitlines()) < 7 and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [json.loads(x) for x in Path(record).read_text().splitlines()]
    assert len(lines) == 7  # the seven requests above, in order
    for rec in lines:
        assert rec["prompt_len"] > 0 and rec["output_len"] == 2 and rec["block_size"] == 16
        assert len(rec["block_hashes"]) == rec["prompt_len"] // 16
        assert all(len(h) == 32 and int(h, 16) >= 0 for h in rec["block_hashes"])
        assert sum(rec["sources"].values()) == rec["cached_tokens"]
        assert sum(rec["sources"].values()) + sum(rec["misses"].values()) == rec["prompt_len"]
    text = Path(record).read_text()
    assert "museum" not in text and "another-tenant" not in text  # no text, no salt
    assert lines[0]["block_hashes"] == lines[1]["block_hashes"] != lines[2]["block_hashes"]
    assert lines[0]["scope"] is None and lines[2]["scope"] is not None
    assert lines[2]["misses"]["different_salt"] == full  # the operator's record keeps the reason
    arrivals = [rec["arrival_s"] for rec in lines]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0


def test_bench_serve_prints_the_breakdown(disk_server, capsys, tmp_path):
    server, _, _ = disk_server
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    saved = tmp_path / "bench.json"
    args = parser.parse_args(["--base-url", server.url, "--dataset", "prefix-repetition", "--num-prompts", "6",
                              "--num-prefixes", "2", "--prefix-len", "64", "--suffix-len", "16",
                              "--random-output-len", "2", "--max-concurrency", "1", "--no-progress",
                              "--save-result", str(saved)])  # one at a time: each repeat finds its prefix cached
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Prompt tokens from device" in out and "Prompt tokens missed: first_seen" in out
    summary = json.loads(saved.read_text())
    split = summary["prompt_kv_breakdown"]
    assert sum(split["sources"].values()) + sum(split["misses"].values()) == summary["total_input_tokens"]
    assert split["sources"]["device"] >= 4 * 64  # each prefix's later prompts hit it
