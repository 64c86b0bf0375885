"""Regressions of #13 against the real server: a bad request is a 400 that touches nothing, so
the streams in flight beside it finish exactly as they would alone and every KV block comes
back (items 1, 2, 9); oversized bodies are 413 the same way (item 7)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from conftest import AUTH, MAX_REQUEST_BYTES, wait_idle

STREAM_PROMPTS = ["The history of the printing press", "A recipe for bread:"]
STREAM_TOKENS = 20


def _stream(server, model: str, prompt: str, started: threading.Event, out: list) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, lines = [], []
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                started.set()
                if line != "data: [DONE]":
                    text.extend(c["text"] for c in json.loads(line[6:])["choices"])
    out.append(("".join(text), lines[-1]))


@pytest.fixture(scope="module")
def solo(server, model_id) -> list[str]:
    """Each stream's text when it runs alone."""
    texts = []
    for p in STREAM_PROMPTS:
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120, json={
            "model": model_id, "prompt": p, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True})
        texts.append(r.json()["choices"][0]["text"])
    return texts


def while_streams_run(server, model: str, solo: list[str], send) -> httpx.Response:
    """`send()` while two greedy streams run; they must end as they do alone, and every block
    must be free afterwards."""
    outs: list[list] = [[] for _ in STREAM_PROMPTS]
    started = [threading.Event() for _ in STREAM_PROMPTS]
    threads = [threading.Thread(target=_stream, args=(server, model, p, e, o))
               for p, e, o in zip(STREAM_PROMPTS, started, outs, strict=True)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    r = send()
    for t in threads:
        t.join(120)
    assert [o[0] for o in outs] == [(t, "data: [DONE]") for t in solo]
    m = wait_idle(server)
    assert m["kvpool:kv_blocks_free"] == m["kvpool:kv_blocks_capacity"]
    assert m["kvpool:num_requests_running"] == 0 and m["kvpool:num_requests_waiting"] == 0
    return r


def _raw(server, path: str, body: dict) -> httpx.Response:
    """The body as Python's json writes it: NaN stays NaN, a lone surrogate stays a \\ud800 escape."""
    return httpx.post(f"{server.url}{path}", headers={**AUTH, "Content-Type": "application/json"},
                      content=json.dumps(body).encode(), timeout=60)


CHAT = [{"role": "user", "content": "hi"}]
BAD = {
    "1-seed-2**70": ("/v1/completions", {"prompt": "hi", "seed": 2**70, "max_tokens": 4}, "seed"),
    "2-stop-id-out-of-vocab": ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**12], "min_tokens": 2,
                                                   "max_tokens": 4}, "stop_token_ids"),
    "2-seed-no-room-for-n": ("/v1/completions", {"prompt": "hi", "seed": 2**64 - 1, "n": 2, "max_tokens": 4},
                             "seed"),
    "9-nan-temperature": ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}, "temperature"),
    "9-inf-top-p": ("/v1/chat/completions", {"messages": CHAT, "top_p": float("inf")}, "top_p"),
    "9-bool-max-tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    "9-bool-token-ids": ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    "9-lone-surrogate": ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    "9-lone-surrogate-chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfff"}]},
                              "messages"),
    "9-template-kwargs-messages": ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {
        "messages": []}}, "chat_template_kwargs"),
    "9-template-kwargs-generation-prompt": ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {
        "add_generation_prompt": False}}, "chat_template_kwargs"),
    "9-detokenize-negative": ("/detokenize", {"tokens": [-1]}, "tokens"),
    "9-detokenize-huge": ("/detokenize", {"tokens": [2**40]}, "tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_is_400_and_leaves_the_streams_beside_it_untouched(server, model_id, solo, case):
    path, body, param = BAD[case]
    r = while_streams_run(server, model_id, solo, lambda: _raw(server, path, {"model": model_id, **body}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_unknown_fields_are_ignored_and_unsupported_or_bad_ones_refused(server, model_id):
    ignored = {"store": True, "user": 42, "parallel_tool_calls": False, "reasoning_effort": "low",
               "metadata": {"k": "v"}, "service_tier": "auto", "temperature_typo": 0.5}
    r = _raw(server, "/v1/chat/completions", {"model": model_id, "messages": CHAT, "max_tokens": 2, **ignored})
    assert r.status_code == 200, r.text
    for field, value in [("response_format", {"type": "yaml"}), ("tools", [{"type": "function"}]),
                         ("tool_choice", "required"), ("logit_bias", {"1": 500}), ("frequency_penalty", 5),
                         ("guided_json", 3), ("best_of", 0), ("prompt_logprobs", 1)]:
        r = _raw(server, "/v1/chat/completions", {"model": model_id, "messages": CHAT, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = _raw(server, "/v1/completions", {"model": model_id, "prompt": "hi", "max_tokens": "2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_oversized_bodies_are_413_declared_or_streamed(server, model_id, solo):
    big = json.dumps({"model": model_id, "prompt": "x" * MAX_REQUEST_BYTES}).encode()

    def send() -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                          content=big, timeout=60)

    r = while_streams_run(server, model_id, solo, send)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds while the body arrives
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = httpx.post(f"{server.url}/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                   content=chunks(), timeout=60)
    assert r.status_code == 413
    # just under the limit: read and judged on its merits (the prompt is longer than the context)
    fits = json.dumps({"model": model_id, "prompt": "word " * ((MAX_REQUEST_BYTES - 200) // 5)}).encode()
    r = httpx.post(f"{server.url}/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                   content=fits, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
