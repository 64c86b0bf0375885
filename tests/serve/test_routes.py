"""Every route of the server and of the conductor is either in the documented open list or
answers 401 without the key (#13 item 6), read from the apps' own route tables so a route
added later is covered too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import CLUSTER_KEY, KEYS
from starlette.routing import Route
from starlette.testclient import TestClient

from kvpool.cluster.gateway import OPEN_ROUTES as CONDUCTOR_OPEN
from kvpool.cluster.gateway import GatewayConfig, build_gateway
from kvpool.serve.app import OPEN_ROUTES as SERVER_OPEN

# what docs/serving.md and docs/cluster.md list as open (no key): keep them in step
DOCUMENTED_OPEN = {"/health"}
SERVER_DOCUMENTED_OPEN = DOCUMENTED_OPEN | {"/ping"}  # vLLM's name for /health, which probes call


def _walk(routes, prefix: str = "") -> Iterator[tuple[str, str]]:
    for r in routes:
        inner = getattr(r, "original_router", None)  # FastAPI >= 0.16x keeps included routers whole
        if inner is not None:
            yield from _walk(inner.routes, prefix + r.include_context.prefix)
        elif isinstance(r, Route):
            yield from ((m, prefix + r.path) for m in r.methods or () if m != "HEAD")


def _routes(app) -> list[tuple[str, str]]:
    return sorted(set(_walk(app.routes)))


def _assert_keyed(client: TestClient, routes: list[tuple[str, str]], open_paths: set[str],
                  good: dict[str, str]) -> None:
    assert routes
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"Authorization": b"Bearer \xc3\xa9\xff"}):
            r = client.request(method, path, headers=headers)
            if path in open_paths:
                assert r.status_code != 401, (method, path)
            else:
                assert r.status_code == 401, (method, path, r.status_code, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
        if path not in open_paths:  # and the key opens it (whatever the route then says about the body)
            assert client.request(method, path, headers=good.get(path[:10], good["*"])).status_code != 401


def test_every_server_route_is_open_by_the_list_or_needs_the_key(inprocess):
    client, _ = inprocess
    assert SERVER_OPEN == SERVER_DOCUMENTED_OPEN
    routes = _routes(client.app)
    assert {p for _, p in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics",
                                      "/tokenize", "/detokenize", "/reset_prefix_cache", "/internal/state",
                                      "/internal/generate", "/version", "/ping"}
    good = {"*": f"Bearer {KEYS[0]}", "/internal/": f"Bearer {CLUSTER_KEY}"}
    _assert_keyed(client, routes, set(SERVER_OPEN), {k: {"Authorization": v} for k, v in good.items()})


def test_internal_routes_refuse_an_api_key(inprocess):
    client, _ = inprocess
    assert client.get("/internal/state", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 401


@pytest.fixture(scope="module")
def conductor() -> Iterator[TestClient]:
    from kvpool.conductor.predictor import CPU_PREDICTOR
    from kvpool.engine.loader import load_tokenizer

    config = GatewayConfig(instances=["http://127.0.0.1:9"], api_keys=list(KEYS), cluster_key=CLUSTER_KEY,
                           poll_interval_s=5.0)
    with TestClient(build_gateway(config, CPU_PREDICTOR, load_tokenizer(None))) as client:
        yield client


def test_every_conductor_route_is_open_by_the_list_or_needs_the_key(conductor):
    assert CONDUCTOR_OPEN == DOCUMENTED_OPEN
    routes = _routes(conductor.app)
    assert {p for _, p in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics",
                                      "/cluster", "/cluster/match"}
    _assert_keyed(conductor, routes, set(CONDUCTOR_OPEN), {"*": {"Authorization": f"Bearer {KEYS[1]}"}})


def test_docs_and_openapi_are_off(inprocess, conductor):
    for client in (inprocess[0], conductor):
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path, headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 404
