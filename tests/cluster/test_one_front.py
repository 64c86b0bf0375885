"""One OpenAI front: the same requests sent to a `kvpool serve` instance and to the conductor in
front of it get the same status and the same body (errors whole; responses in shape, text,
logprobs, usage and defaults). A colocated cluster of one instance, no pool: one model load."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from cluster_helpers import running_cluster

from kvpool.cluster.local import ClusterSpec, LocalCluster

MAX_MODEL_LEN = 1024
INSTANCE_ARGS = ["--dtype", "float32", "--num-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN),
                 "--threads", "1"]
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
# (route, extra body): plain, and with every logprobs field the conductor relays
LOGPROBS = {"/v1/completions": {"logprobs": 2, "prompt_logprobs": 1}, "/v1/chat/completions": {
    "logprobs": True, "top_logprobs": 2}}
CASES = [(route, extra) for route in LOGPROBS for extra in ({}, LOGPROBS[route])]
CASE_IDS = [f"{route}-{'logprobs' if extra else 'plain'}" for route, extra in CASES]

# (route, body): each refused the same way by both servers
BAD = [
    ("/v1/completions", {"prompt": PROMPT, "seed": 2**70}),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1.0}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5000}),
    ("/v1/completions", {"prompt": [1, 2, 10**7], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}),
    ("/v1/completions", {"prompt": PROMPT, "model": "no-such-model"}),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": 9, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 2000}),
    ("/v1/chat/completions", {"messages": []}),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(colocated=1, pool="none", instance_args=INSTANCE_ARGS,
                       log_dir=str(tmp_path_factory.mktemp("one-front")))
    yield from running_cluster(spec)


def _both(cluster: LocalCluster, route: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
    """(the instance's answer, the conductor's), the prompt's KV cached before both (so both
    report the same cached tokens and sources)."""
    instance = cluster.urls("both")[0]
    httpx.post(instance + route, json=body, timeout=120)
    return tuple(httpx.post(url + route, json=body, timeout=120) for url in (instance, cluster.conductor_url))


def _shape(value):
    """Keys and value types, recursively (what a client's parser relies on)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__


def _without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.mark.parametrize(("route", "body"), BAD, ids=[f"{r}-{json.dumps(b)[:40]}" for r, b in BAD])
def test_a_bad_request_gets_the_same_error_from_serve_and_the_conductor(cluster, route, body):
    served, routed = _both(cluster, route, body)
    assert served.status_code in (400, 404, 422), served.text
    assert (routed.status_code, routed.json()) == (served.status_code, served.json())


@pytest.mark.parametrize(("route", "extra"), CASES, ids=CASE_IDS)
def test_a_whole_response_is_the_same_through_either(cluster, route, extra):
    body = {"max_tokens": 8, "temperature": 0, **extra, **({"prompt": PROMPT} if "chat" not in route else
                                                            {"messages": MESSAGES})}
    served, routed = _both(cluster, route, body)
    assert served.status_code == routed.status_code == 200, routed.text
    assert _without_ids(routed.json()) == _without_ids(served.json())  # text, logprobs, usage, fingerprint, model
    logprobs = served.json()["choices"][0]["logprobs"]
    assert (logprobs is not None) == bool(extra)
    if "prompt_logprobs" in extra:
        assert len(routed.json()["choices"][0]["prompt_logprobs"]) == served.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("route", "extra"), CASES, ids=CASE_IDS)
def test_a_stream_is_the_same_through_either(cluster, route, extra):
    body = {"max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **extra,
            **({"prompt": PROMPT} if "chat" not in route else {"messages": MESSAGES})}
    answers = []
    instance = cluster.urls("both")[0]
    for url in (instance, instance, cluster.conductor_url):  # the first caches the prompt
        with httpx.stream("POST", url + route, json=body, timeout=120) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for ch in chunks
                       for c in ch["choices"])
        finish = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
        logprobs = [(c["logprobs"], c.get("prompt_logprobs")) for ch in chunks for c in ch["choices"]]
        answers.append((text, finish, chunks[-1]["usage"], _shape(_without_ids(chunks[0])),
                        {_without_ids(ch)["model"] for ch in chunks}, logprobs))
    assert answers[2] == answers[1]
    assert any(lp is not None for lp, _ in answers[2][-1]) == bool(extra)


def test_echo_is_refused_by_name_through_the_conductor(cluster):
    """The conductor does not relay echo (docs/cluster.md): a 400 naming it, where the instance
    echoes the prompt."""
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True}
    served, routed = _both(cluster, "/v1/completions", body)
    assert served.status_code == 200 and served.json()["choices"][0]["text"].startswith(PROMPT)
    assert routed.status_code == 400 and routed.json()["error"]["param"] == "echo"


def test_the_default_max_tokens_is_the_rest_of_the_context_through_either(cluster):
    """No max_tokens: both fill the context (the KV pool, 4096 tokens, is larger)."""
    words = " ".join(f"w{i}" for i in range(270))  # 1000 prompt tokens
    body = {"messages": [{"role": "user", "content": words}], "temperature": 0, "ignore_eos": True}
    served, routed = _both(cluster, "/v1/chat/completions", body)
    assert served.status_code == routed.status_code == 200, routed.text
    usage = served.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN, usage
    assert routed.json()["usage"]["completion_tokens"] == usage["completion_tokens"]
    assert routed.json()["choices"][0]["message"] == served.json()["choices"][0]["message"]


def test_the_model_list_and_card_are_the_same_through_either(cluster):
    instance, conductor = cluster.urls("both")[0], cluster.conductor_url
    listed = [httpx.get(url + "/v1/models").json() for url in (instance, conductor)]
    for card in listed[0]["data"] + listed[1]["data"]:
        card.pop("created")
    assert listed[1] == listed[0]
    name = listed[0]["data"][0]["id"]
    for path in (f"/v1/models/{name}", "/v1/models/no-such-model"):
        got = [httpx.get(url + path) for url in (instance, conductor)]
        assert got[1].status_code == got[0].status_code
        assert {k: v for k, v in got[1].json().items() if k != "created"} == \
            {k: v for k, v in got[0].json().items() if k != "created"}
