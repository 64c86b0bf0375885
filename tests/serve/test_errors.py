"""Bad requests get OpenAI-style error bodies with the right status, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

AUTH = {"Authorization": "Bearer test-key"}


def post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers={**AUTH, **kw.pop("headers", {})}, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hi", "n": 99}, "n"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "presence_penalty": 3.0}, "presence_penalty"),
    ({"prompt": "hi", "repetition_penalty": "1.3"}, "repetition_penalty"),
    ({"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "hi", "echo": True, "logprobs": 30}, "logprobs"),
    ({"prompt": "word " * 1100, "max_tokens": 4}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
])
def test_bad_completion_parameters_are_400_naming_the_param(server, model_id, body, param):
    assert_error(post(server, "/v1/completions", json={"model": model_id, **body}), 400, param)


def test_vllm_bench_serve_payload_is_accepted(server, model_id):
    """`vllm bench serve` sends neutral vLLM extensions (repetition_penalty 1.0, logprobs null)."""
    body = {"model": model_id, "prompt": "Hello there", "repetition_penalty": 1.0, "max_tokens": 3,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    r = post(server, "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]")


def test_malformed_json_is_400(server):
    err = assert_error(post(server, "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    assert "JSON" in err["message"]


def test_missing_messages_in_chat_is_400(server, model_id):
    assert_error(post(server, "/v1/chat/completions", json={"model": model_id}), 400, "messages")


def test_unknown_model_is_404(server):
    err = assert_error(post(server, "/v1/completions", json={"model": "gpt-17", "prompt": "hi"}), 404, "model")
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}])
def test_v1_routes_need_the_api_key(server, headers):
    r = httpx.get(f"{server.url}/v1/models", headers=headers)
    assert assert_error(r, 401)["type"] == "authentication_error"


def test_health_needs_no_key_and_metrics_does_by_default(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert_error(httpx.get(f"{server.url}/metrics"), 401)
    assert httpx.get(f"{server.url}/metrics", headers=AUTH).status_code == 200


def test_server_keeps_serving_after_errors(server, model_id):
    post(server, "/v1/completions", json={"model": model_id, "prompt": "hi", "n": 1000})
    r = post(server, "/v1/completions", json={"model": model_id, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
