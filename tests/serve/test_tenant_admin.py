"""#31 item 1: a tenant's /reset_prefix_cache touches only its own namespace and counts only its
own blocks; the --admin-api-key resets the whole server (a real server, three keys)."""

from __future__ import annotations

import httpx
import pytest
from conftest import start_server, wait_idle

K1, K2, ADMIN = "tenant-one-key", "tenant-two-key", "the-admin-key"
PROMPT = "Tenant one's long private preamble about ledgers, ships and harbours, told twice. " * 4


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tenants():
    s = start_server("--api-key", K1, "--api-key", K2, "--admin-api-key", ADMIN, headers=_auth(K1))
    yield s
    s.stop()


def _cached(server, key: str, prompt: str = PROMPT, **extra) -> int:
    r = httpx.post(f"{server.url}/v1/completions", headers=_auth(key), timeout=60,
                   json={"prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _reset(server, key: str | None) -> httpx.Response:
    wait_idle(server)
    return httpx.post(f"{server.url}/reset_prefix_cache", headers=_auth(key) if key else {})


def test_a_tenants_reset_leaves_other_tenants_cached_prefixes(tenants):
    _cached(tenants, K1)
    hit = _cached(tenants, K1)
    assert hit >= 48
    r = _reset(tenants, K2)
    assert r.status_code == 200 and r.json() == {"evicted_blocks": 0, "scope": "tenant"}
    assert _cached(tenants, K1) == hit  # k2 could neither evict nor count k1's blocks


def test_a_tenants_reset_evicts_its_own_blocks_and_counts_only_them(tenants):
    _cached(tenants, K2, "Tenant two writes its own notes on rivers and bridges. " * 4)
    _cached(tenants, K1)
    r = _reset(tenants, K2)
    assert r.status_code == 200 and r.json()["scope"] == "tenant"
    own = r.json()["evicted_blocks"]
    assert own >= 3
    assert _cached(tenants, K2, "Tenant two writes its own notes on rivers and bridges. " * 4) == 0
    assert _cached(tenants, K1) >= 48


def test_the_admin_key_resets_every_tenant_and_the_shared_scope(tenants):
    _cached(tenants, K1)
    _cached(tenants, K2, PROMPT, cache_scope="shared")
    r = _reset(tenants, ADMIN)
    assert r.status_code == 200 and r.json()["scope"] == "server" and r.json()["evicted_blocks"] >= 6
    assert tenants.metrics()["kvpool:kv_blocks_cached"] == 0
    assert _cached(tenants, K1) == 0 and _cached(tenants, K2, PROMPT, cache_scope="shared") == 0


def test_the_admin_key_is_not_a_tenant_key_and_no_key_resets_nothing(tenants):
    assert _reset(tenants, None).status_code == 401
    assert _reset(tenants, "wrong").status_code == 401
    r = httpx.post(f"{tenants.url}/v1/completions", headers=_auth(ADMIN), json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 401
    assert httpx.get(f"{tenants.url}/metrics", headers=_auth(ADMIN)).status_code == 200


def test_a_scoped_reset_evicts_exactly_the_owned_idle_blocks():
    from kvpool.core.kv_manager import KVCacheManager
    from kvpool.serve.auth import KeyRing

    ring = KeyRing.build([K1, K2])
    (_, one), (_, two) = ring.api_keys
    kv = KVCacheManager(64, 4, record_events=True)
    salts = {1: one.salt, 2: f"{one.salt}/private", 3: two.salt, 4: None, 5: "shared-salt"}
    for sid, salt in salts.items():
        tokens = list(range(sid * 100, sid * 100 + 12))
        kv.allocate(sid, tokens, cache_salt=salt)
        kv.commit(sid, tokens, 12)
    for sid in (1, 2, 4, 5):  # 3 (tenant two) still runs: its blocks are in use
        kv.free(sid)
    kv.drain_events()
    idle_of_one = 2 * 3  # sequences 1 and 2, 3 full blocks each
    assert kv.reset_prefix_cache(two.owns) == 0  # two's blocks are in use; one's are not two's
    assert kv.reset_prefix_cache(one.owns) == idle_of_one
    assert len(kv.drain_events().evicted) == idle_of_one
    assert kv.reset_prefix_cache(one.owns) == 0
    assert kv.reset_prefix_cache() == 2 * 3  # the admin's: the unsalted and shared ones
    kv.free(3)
    assert kv.reset_prefix_cache(two.owns) == 3
    usage = kv.usage()
    assert usage.free_blocks == usage.total_blocks and usage.cached_blocks == 0
