"""#31 item 8: a server with a disk tier, SIGKILLed and started again on the same directory,
serves its earlier prompts' KV from disk (a device cache is empty after a restart) and the
outputs are those of the first run."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from conftest import start_server

from kvpool.store.disk import SUBDIR, SUFFIX

PROMPT = "The ledger of the harbour master, page one: " + " ".join(f"crate {i} of tea," for i in range(40))


def _complete(server) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=300,
                   json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_a_sigkilled_server_restarted_on_its_disk_tier_serves_the_disk_hits(tmp_path):
    flags = ["--kv-disk-path", str(tmp_path), "--kv-disk-size", "256MiB"]
    first = start_server(*flags)
    try:
        before = _complete(first)
        blocks = before["usage"]["prompt_tokens"] // 16
        deadline = time.monotonic() + 60  # write-through saves run beside the engine
        while len(list((tmp_path / SUBDIR).glob(f"*{SUFFIX}"))) < blocks and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list((tmp_path / SUBDIR).glob(f"*{SUFFIX}"))) >= blocks
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(60)
    second = start_server(*flags)
    try:
        after = _complete(second)
        cached = after["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (blocks - 1) * 16  # from disk: this process's device cache started empty
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert second.metrics()["kvpool:num_requests_running"] == 0
    finally:
        assert second.stop() == 0
