"""vLLM's metric names, types and buckets on a live server's /metrics, checked by promtool too."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import httpx
import pytest
from conftest import Server, start_server
from prometheus_client.parser import text_string_to_metric_families

from kvpool.serve.metrics import buckets_1_2_5

# name after the prefix -> the type vLLM gives it
VLLM_METRICS = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
    "num_requests_waiting_by_reason": "gauge", "cache_config_info": "gauge",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter", "num_preemptions": "counter",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "prompt_tokens_cached": "counter",
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "request_max_num_generation_tokens": "histogram", "request_params_n": "histogram",
    "request_params_max_tokens": "histogram", "iteration_tokens_total": "histogram",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram", "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram", "request_inference_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram", "request_decode_time_seconds": "histogram",
}


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[Server]:
    s = start_server("--metrics-prefix", "vllm", "--no-cpu-weight-packing")  # packing is not under test
    yield s
    assert s.stop() == 0, s.log.read_text()


@pytest.fixture(scope="module")
def metrics_text(vllm_server: Server) -> str:
    r = httpx.post(f"{vllm_server.url}/v1/completions", timeout=120, json={
        "model": httpx.get(f"{vllm_server.url}/v1/models").json()["data"][0]["id"],
        "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    return httpx.get(f"{vllm_server.url}/metrics").text


def test_every_vllm_metric_is_there_with_its_type(metrics_text):
    families = {f.name: f for f in text_string_to_metric_families(metrics_text)}
    for name, kind in VLLM_METRICS.items():
        fam = families.get(f"vllm:{name}")
        assert fam is not None, f"vllm:{name} missing"
        assert fam.type == kind, (name, fam.type)


def test_per_request_histograms_saw_the_request(metrics_text):
    samples = {s.name: s for f in text_string_to_metric_families(metrics_text) for s in f.samples
               if not s.labels.get("le")}
    assert samples["vllm:request_params_n_sum"].value == 2
    assert samples["vllm:request_params_max_tokens_sum"].value == 5
    assert samples["vllm:request_generation_tokens_sum"].value == 10  # two sequences of 5
    assert samples["vllm:request_prompt_tokens_count"].value == 1
    assert samples["vllm:iteration_tokens_total_count"].value >= 5
    assert samples["vllm:request_decode_time_seconds_count"].value == 1


def test_buckets_are_vllms(metrics_text):
    def bounds(name: str) -> list[float]:
        fam = next(f for f in text_string_to_metric_families(metrics_text) if f.name == name)
        return [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]

    assert bounds("vllm:request_prompt_tokens") == list(buckets_1_2_5(1024))
    assert bounds("vllm:request_params_n") == [1, 2, 5, 10, 20]
    assert bounds("vllm:iteration_tokens_total")[:3] == [1, 8, 16]
    assert bounds("vllm:e2e_request_latency_seconds")[0] == 0.3
    assert bounds("vllm:time_to_first_token_seconds")[-1] == 2560.0


def test_buckets_1_2_5_stop_at_the_limit():
    assert buckets_1_2_5(1024) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert buckets_1_2_5(5) == (1, 2, 5)


# vLLM's own histogram name, kept for its dashboards; promtool flags it on vLLM's /metrics too
VLLM_NAME_LINT = 'vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix'


def test_promtool_finds_nothing_but_the_colon_and_vllms_own_name(metrics_text):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    out = subprocess.run([promtool, "check", "metrics"], input=metrics_text, capture_output=True, text=True)
    problems = [line for line in (out.stdout + out.stderr).splitlines()
                if line.strip() and "metric names should not contain ':'" not in line and line != VLLM_NAME_LINT]
    assert not problems, "\n".join(problems)
