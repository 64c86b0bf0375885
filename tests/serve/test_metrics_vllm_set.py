"""vLLM's whole metric set under --metrics-prefix vllm on a live server with a host KV tier:
what vLLM's Grafana dashboard plots, the process/python and HTTP collectors, the tiered store's
hits as external-prefix-cache counters, prompt tokens by source, per-request preemptions and
computed prefill tokens; promtool finds nothing but what it finds on vLLM too."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import httpx
import pytest
from conftest import Server, start_server
from prometheus_client.parser import text_string_to_metric_families

# Every vllm:* name vLLM's example dashboard queries: examples/online_serving/prometheus_grafana/grafana.json
# in vllm-project/vllm (panels: E2E latency, token throughput, TPOT, scheduler state, TTFT, cache
# utilization, prompt/generation length heatmaps, finish reason, queue time, prefill/decode time,
# max generation tokens).
GRAFANA_VLLM_DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_swapped",
    "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket", "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
)
# family name -> type, beside tests/serve/test_vllm_metrics.py's engine set
EXTRA_FAMILIES = {
    "process_cpu_seconds": "counter", "process_resident_memory_bytes": "gauge", "process_open_fds": "gauge",
    "python_info": "gauge", "python_gc_objects_collected": "counter",
    "http_requests": "counter", "http_request_duration_seconds": "histogram",
    "http_request_duration_highr_seconds": "histogram",
    "vllm:external_prefix_cache_queries": "counter", "vllm:external_prefix_cache_hits": "counter",
    "vllm:prompt_tokens_by_source": "counter", "vllm:prompt_tokens_cached_by_source": "counter",
    "vllm:request_num_preemptions": "histogram", "vllm:request_prefill_kv_computed_tokens": "histogram",
}
PROMPT = "Once upon a time, in a land far away, there lived a king who loved stories. " * 6


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[Server]:
    # 24 blocks: three other prompts push a prompt's blocks out of the device cache into the store's
    s = start_server("--metrics-prefix", "vllm", "--kv-host-memory", "64MiB", "--no-cpu-weight-packing",
                     "--num-blocks", "24", "--max-model-len", "256")
    yield s
    assert s.stop() == 0, s.log.read_text()


def _complete(server: Server, prompt: str = PROMPT) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


@pytest.fixture(scope="module")
def scraped(vllm_server: Server) -> tuple[str, list[dict]]:
    """/metrics after a prompt, three others that evict it from the device, the first again
    (from the store), and a request to a path no route serves."""
    usages = [_complete(vllm_server, p) for p in (PROMPT, *(f"{k} {PROMPT}" for k in ("Two", "Three", "Four")))]
    usages.append(_complete(vllm_server))
    assert httpx.get(f"{vllm_server.url}/no/such/path").status_code == 404
    return httpx.get(f"{vllm_server.url}/metrics").text, usages


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _value(text: str, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in _samples(text).items() if n == name and labels.items() <= dict(lab).items())


def test_every_name_of_vllms_grafana_dashboard_is_exported(scraped):
    names = {n for n, _ in _samples(scraped[0])}
    assert [n for n in GRAFANA_VLLM_DASHBOARD if n not in names] == []


def test_process_python_http_and_cache_source_families_have_vllms_types(scraped):
    families = {f.name: f.type for f in text_string_to_metric_families(scraped[0])}
    assert {name: families.get(name) for name in EXTRA_FAMILIES} == EXTRA_FAMILIES


def test_http_metrics_count_each_route_by_its_template_and_status_class(scraped):
    text = scraped[0]
    assert _value(text, "http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 5
    assert _value(text, "http_requests_total", handler="none", status="4xx") == 1  # no path made a label
    assert _value(text, "http_request_duration_seconds_count", handler="/v1/completions") == 5
    bounds = sorted({float(dict(lab)["le"]) for (n, lab), _ in _samples(text).items()
                     if n == "http_request_duration_seconds_bucket"} - {float("inf")})
    assert bounds == [0.1, 0.5, 1.0]


def test_store_hits_are_external_prefix_cache_hits_and_prompt_tokens_add_up_by_source(scraped):
    text, usages = scraped
    external = _value(text, "vllm:external_prefix_cache_hits_total")
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert 0 < external <= cached[-1]  # the last prompt's blocks the device had evicted came from the store
    assert _value(text, "vllm:external_prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    by_source = {s: _value(text, "vllm:prompt_tokens_by_source_total", source=s)
                 for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert by_source["external_kv_transfer"] == external
    assert sum(by_source.values()) == sum(u["prompt_tokens"] for u in usages)
    assert _value(text, "vllm:prompt_tokens_cached_by_source_total", source="external_kv_transfer") == external
    assert _value(text, "vllm:prompt_tokens_cached_by_source_total") == sum(cached)  # device + store = usage


def test_per_request_histograms_count_computed_prefill_tokens_and_preemptions(scraped):
    text, usages = scraped
    computed = sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert _value(text, "vllm:request_prefill_kv_computed_tokens_sum") == computed
    assert _value(text, "vllm:request_num_preemptions_count") == 5
    assert _value(text, "vllm:request_num_preemptions_sum") == 0


# vLLM's own histogram name, kept for its dashboards; promtool flags it on vLLM's /metrics too
VLLM_NAME_LINT = 'vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix'


def test_promtool_finds_nothing_but_the_colon_and_vllms_own_name(scraped):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    out = subprocess.run([promtool, "check", "metrics"], input=scraped[0], capture_output=True, text=True)
    problems = [line for line in (out.stdout + out.stderr).splitlines()
                if line.strip() and "metric names should not contain ':'" not in line and line != VLLM_NAME_LINT]
    assert not problems, "\n".join(problems)
