"""/metrics, /tokenize, /detokenize, /reset_prefix_cache, and aborting on client disconnect."""

from __future__ import annotations

import httpx
from conftest import wait_idle

AUTH = {"Authorization": "Bearer test-key"}
METRICS = [
    "kvpool:kv_cache_usage_perc", "kvpool:prefix_cache_queries_total", "kvpool:prefix_cache_hits_total",
    "kvpool:num_preemptions_total", "kvpool:num_requests_running", "kvpool:num_requests_waiting",
    "kvpool:num_requests_swapped", "kvpool:prompt_tokens_total", "kvpool:generation_tokens_total",
    "kvpool:time_to_first_token_seconds_count", "kvpool:inter_token_latency_seconds_count",
    "kvpool:e2e_request_latency_seconds_count", "kvpool:request_queue_time_seconds_count",
    "kvpool:kv_blocks_capacity", "kvpool:kv_blocks_free", "kvpool:kv_blocks_cached",
]


def test_metrics_expose_every_series_and_count_tokens(server, model_id):
    before = server.metrics()
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": model_id, "prompt": "Count with me: one two three", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    after = wait_idle(server)
    for name in METRICS:
        assert name in after, name
    assert after["kvpool:generation_tokens_total"] - before.get("kvpool:generation_tokens_total", 0) >= 5
    assert after["kvpool:e2e_request_latency_seconds_count"] >= before["kvpool:e2e_request_latency_seconds_count"] + 1
    assert after["kvpool:kv_blocks_capacity"] == 256


def test_tokenize_detokenize_round_trip(server):
    text = "Paged attention stores KV in blocks."
    tokens = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": text, "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 3
    back = httpx.post(f"{server.url}/detokenize", headers=AUTH, json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert back == text


def test_tokenize_messages_uses_the_chat_template(server):
    r = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"messages": [{"role": "user", "content": "hi"}]}).json()
    plain = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": "hi"}).json()
    assert r["count"] > plain["count"]


def test_reset_prefix_cache_empties_the_tenants_cached_blocks(server, model_id):
    body = {"model": model_id, "prompt": "cache me " * 40, "max_tokens": 1}
    httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60, json=body)
    wait_idle(server)
    r = httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 200 and r.json()["evicted_blocks"] >= 1
    again = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60, json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, model_id):
    before = server.metrics()["kvpool:request_aborted_total"]
    body = {"model": model_id, "prompt": "Write a very long essay about caches.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    m = wait_idle(server)
    assert m["kvpool:num_requests_running"] == 0
    assert m["kvpool:kv_blocks_free"] == m["kvpool:kv_blocks_capacity"]
    assert m["kvpool:request_aborted_total"] == before + 1
