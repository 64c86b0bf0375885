"""#32 item 1: retention through a real `kvpool serve` (32 blocks of 16 tokens, so a few prompts
evict everything unretained): kvpool_retention on completions, cache_control on chat, the admin
pin routes per tenant, their 400s by name, and the retention metrics."""

from __future__ import annotations

import httpx
import pytest
from conftest import start_server, wait_idle

K1, K2, ADMIN = "retention-tenant-one", "retention-tenant-two", "retention-admin"
SYSTEM = "You are the harbour master's ledger assistant; answer in one word about ships. " * 3
PROMPT = "The ledger of ships that entered the harbour this season, carefully kept by the clerk. " * 3


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def srv():
    s = start_server("--api-key", K1, "--api-key", K2, "--admin-api-key", ADMIN, "--num-blocks", "32",
                     "--max-model-len", "512", headers=_auth(K1))
    yield s
    assert s.stop() == 0, s.log.read_text()


def _complete(srv, prompt: str, key: str = K1, **extra) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", headers=_auth(key), timeout=120,
                      json={"prompt": prompt, "max_tokens": 1, **extra})


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _churn(srv, tag: str) -> None:
    """Distinct prompts of ~7 blocks each, 48+ blocks in all: every unretained block goes."""
    for i in range(7):
        _cached(_complete(srv, f"{tag} {i}: " + f"rivers, bridges and the number {i} counted slowly. " * 9))
    wait_idle(srv)


def test_kvpool_retention_keeps_a_completion_prefix_through_churn(srv):
    other = "An unretained note about lighthouses and their keepers, written once. " * 3
    _cached(_complete(srv, other))
    assert _cached(_complete(srv, PROMPT, kvpool_retention={"ttl": "1h", "priority": 3})) == 0
    _churn(srv, "a")
    assert _cached(_complete(srv, PROMPT)) >= 48
    assert _cached(_complete(srv, other)) == 0
    m = srv.metrics()
    assert m["kvpool:kv_pinned_bytes"] > 0
    assert m["kvpool:kv_pinned_evictions_total"] == 0


def test_chat_cache_control_keeps_the_marked_system_prompt(srv):
    def chat(user: str) -> httpx.Response:
        system = {"role": "system", "content": [
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "5m"}}]}
        return httpx.post(f"{srv.url}/v1/chat/completions", headers=_auth(K1), timeout=120,
                          json={"messages": [system, {"role": "user", "content": user}], "max_tokens": 1})

    _cached(chat("Which ship came first?"))
    _churn(srv, "b")
    assert _cached(chat("Which ship came last, and from where did it sail?")) >= 32


def test_admin_pin_routes_are_per_tenant(srv):
    text = "Tenant one's standing instructions for the quay, pinned by its operator. " * 3
    r = httpx.post(f"{srv.url}/v1/kv/pin", headers=_auth(K1), json={"prompt": text, "priority": 10})
    assert r.status_code == 200, r.text
    assert r.json()["scope"] == "tenant" and r.json()["pinned_blocks"] >= 3
    _cached(_complete(srv, text, key=K2))  # the same text in tenant two's namespace: not pinned
    _cached(_complete(srv, text))  # computed in tenant one's: pinned as it registers
    _churn(srv, "c")
    assert _cached(_complete(srv, text)) >= 48
    assert _cached(_complete(srv, text, key=K2)) == 0
    r = httpx.post(f"{srv.url}/v1/kv/unpin", headers=_auth(K2), json={"prompt": text})
    assert r.status_code == 200 and r.json() == {"unpinned_blocks": 0, "scope": "tenant"}
    r = httpx.post(f"{srv.url}/v1/kv/unpin", headers=_auth(K1), json={"prompt": text})
    assert r.json()["unpinned_blocks"] >= 3
    _churn(srv, "d")
    assert _cached(_complete(srv, text)) == 0
    r = httpx.post(f"{srv.url}/v1/kv/pin", headers=_auth(ADMIN), json={"prompt": [1, 2, 3] * 20, "ttl": "30s"})
    assert r.status_code == 200 and r.json()["scope"] == "server" and r.json()["ttl_seconds"] == 30
    assert httpx.post(f"{srv.url}/v1/kv/pin", json={"prompt": text}).status_code == 401


@pytest.mark.parametrize(("body", "param"), [
    ({"kvpool_retention": {"ttl": "5x"}}, "kvpool_retention.ttl"),
    ({"kvpool_retention": {"ttl": "9999h"}}, "kvpool_retention.ttl"),
    ({"kvpool_retention": {"priority": 101}}, "kvpool_retention.priority"),
    ({"kvpool_retention": {"prefix_tokens": 0}}, "kvpool_retention.prefix_tokens"),
    ({"kvpool_retention": {"keep": True}}, "kvpool_retention.keep"),
    ({"kvpool_retention": {"prefix_chars": 5}, "prompt": [1, 2, 3]}, "kvpool_retention.prefix_chars"),
])
def test_a_malformed_kvpool_retention_is_a_400_naming_the_field(srv, body, param):
    body = dict(body)
    r = _complete(srv, body.pop("prompt", "hello"), **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(("cache_control", "param"), [
    ({"type": "persistent"}, "messages[0].content[0].cache_control.type"),
    ({"type": "ephemeral", "ttl": "1d"}, "messages[0].content[0].cache_control.ttl"),
    ({"type": "ephemeral", "scope": "x"}, "messages[0].content[0].cache_control.scope"),
])
def test_a_malformed_cache_control_is_a_400_naming_the_field(srv, cache_control, param):
    msg = {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": cache_control}]}
    r = httpx.post(f"{srv.url}/v1/chat/completions", headers=_auth(K1), json={"messages": [msg], "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "ttl": "0m"}, "ttl"), ({"prompt": "x", "priority": 200}, "priority"),
    ({"prompt": "x", "forever": True}, "forever"),
])
def test_a_malformed_pin_is_a_400_naming_the_field(srv, body, param):
    r = httpx.post(f"{srv.url}/v1/kv/pin", headers=_auth(ADMIN), json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
