"""#31 item 7: with --api-key set, the key is checked before routing, so unknown paths, wrong
methods and redirects (/v1/models/) answer 401 without a key and tell nothing about the routes."""

from __future__ import annotations

import pytest
from conftest import CLUSTER_KEY, KEYS
from test_routes import conductor  # noqa: F401, F811 - the conductor app's fixture

PROBES = [("GET", "/v1/models/"), ("GET", "/no/such/route"), ("POST", "/v1/nothing"), ("GET", "/v1/completions"),
          ("DELETE", "/v1/models"), ("GET", "/internal/nothing"), ("GET", "/.env"), ("GET", "/docs")]


@pytest.mark.parametrize(("method", "path"), PROBES)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", "Basic dGVuYW50LWEta2V5"])
def test_unknown_paths_and_redirects_are_401_without_a_key(inprocess, method, path, authorization):
    client, _ = inprocess
    headers = {"Authorization": authorization} if authorization else {}
    r = client.request(method, path, headers=headers, follow_redirects=False)
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.json()["error"]["type"] == "authentication_error"
    assert "location" not in r.headers


@pytest.mark.parametrize("key", [KEYS[0], CLUSTER_KEY])
def test_behind_a_known_key_unknown_paths_are_404(inprocess, key):
    client, _ = inprocess
    assert client.get("/no/such/route", headers={"Authorization": f"Bearer {key}"}).status_code == 404


def test_behind_an_api_key_the_trailing_slash_is_routed(inprocess):
    client, _ = inprocess
    r = client.get("/v1/models/", headers={"Authorization": f"Bearer {KEYS[0]}"}, follow_redirects=False)
    assert r.status_code in (307, 404)  # a redirect to /v1/models, or the empty id of /v1/models/{id}


def test_the_open_routes_stay_open(inprocess):
    client, _ = inprocess
    assert client.get("/health").status_code == 200
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200


def test_a_body_without_a_key_is_refused_before_it_is_read(inprocess):
    client, _ = inprocess
    r = client.post("/v1/completions", content=b"x" * (8 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 401  # not 413: the size of an unauthenticated body is not looked at



@pytest.mark.parametrize(("method", "path"), PROBES + [("GET", "/internal/state"), ("POST", "/internal/generate")])
def test_the_conductor_checks_the_key_before_routing_too(conductor, method, path):  # noqa: F811
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {CLUSTER_KEY}"}):
        r = conductor.request(method, path, headers=headers, follow_redirects=False)
        assert r.status_code == 401, (headers, r.status_code, r.text)  # the cluster key is no client key here
    assert conductor.get("/no/such/route", headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code == 404
    assert conductor.get("/health").status_code in (200, 503)
