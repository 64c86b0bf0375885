"""#13 items 6, 8 and the gauge part of 12, against the real server (two tenants' keys, a
cluster key, `--role both`)."""

from __future__ import annotations

import httpx
import pytest
from conftest import AUTH, OTHER_AUTH, SERVER_CLUSTER_KEY

CLUSTER_AUTH = {"Authorization": f"Bearer {SERVER_CLUSTER_KEY}"}


def test_kv_gauges_are_right_before_the_first_request(server):
    m = server.initial_metrics
    assert m["kvpool:kv_blocks_capacity"] == 256 and m["kvpool:kv_blocks_free"] == 256


@pytest.mark.parametrize("authorization", [
    "Bearer café".encode(), b"\xff\xfe", b"Bearer \xe2\x82\xac", b"Basic dGVzdC1rZXk=", b"Bearer", b"Bearer  test-key extra",
    b"test-key", b"bearer test-key-but-longer",
])
def test_malformed_or_wrong_authorization_is_401(server, authorization):
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": authorization})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_cache_control_tokenizer_and_docs_routes_need_the_key_or_are_off(server):
    for method, path in [("POST", "/reset_prefix_cache"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/metrics")]:
        assert httpx.request(method, f"{server.url}{path}").status_code == 401, path
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 404, path


def test_internal_routes_need_the_cluster_key_not_an_api_key(server, model_id):
    for headers in ({}, AUTH, {"Authorization": "Bearer wrong"}):
        assert httpx.get(f"{server.url}/internal/state", headers=headers).status_code == 401
        r = httpx.post(f"{server.url}/internal/generate", headers=headers,
                       json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 401
    assert httpx.get(f"{server.url}/internal/state", headers=CLUSTER_AUTH).status_code == 200
    r = httpx.post(f"{server.url}/internal/generate", headers=CLUSTER_AUTH,
                   json={"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.text.strip().splitlines()[-1].startswith("{")


def _cached(server, model: str, headers: dict, prompt: str, **extra) -> int:
    r = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=60,
                   json={"model": model, "prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_tenant_cannot_probe_another_tenants_cached_prefix(server, model_id):
    secret = "Tenant A's confidential memo: the merger closes on the ninth of March at noon. " * 3
    assert _cached(server, model_id, AUTH, secret) == 0
    assert _cached(server, model_id, AUTH, secret) >= 48  # A reuses its own blocks
    assert _cached(server, model_id, OTHER_AUTH, secret) == 0  # B does not see them
    assert _cached(server, model_id, OTHER_AUTH, secret) >= 48  # B's own namespace caches too


def test_tenants_that_opt_into_the_shared_cache_share_it(server, model_id):
    public = "A public system prompt every tenant of this deployment uses, word for word. " * 4
    assert _cached(server, model_id, AUTH, public, cache_scope="shared") == 0
    assert _cached(server, model_id, OTHER_AUTH, public, cache_scope="shared") >= 48
    assert _cached(server, model_id, OTHER_AUTH, public) == 0  # its private namespace is another one
