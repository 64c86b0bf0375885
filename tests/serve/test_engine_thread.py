"""The engine thread's health and what stays off the event loop (#13 items 5 and 7): a stuck
engine turns /health into 503, and tokenization runs on the tokenizer pool, not the loop."""

from __future__ import annotations

import threading
import time

from conftest import KEYS

AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


def test_a_stuck_engine_turns_health_503_and_back_when_it_moves(inprocess):
    client, state = inprocess
    engine = state.engine
    assert client.get("/health").status_code == 200
    release = threading.Event()
    entered = threading.Event()

    def stuck(_engine) -> None:  # what a blocking store read did: the engine thread hangs mid-turn
        entered.set()
        release.wait(30)

    old, engine.watchdog_s = engine.watchdog_s, 0.3
    try:
        done = client.portal.start_task_soon(engine.call, stuck)  # on the app's own event loop
        assert entered.wait(10)
        deadline = time.monotonic() + 10
        while client.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = client.get("/health")
        assert r.status_code == 503 and "no progress" in r.json()["reason"]
        release.set()
        done.result(10)
        assert client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        assert client.get("/health").status_code == 200
    finally:
        release.set()
        engine.watchdog_s = old


def test_tokenization_runs_off_the_event_loop(inprocess):
    client, state = inprocess
    seen: list[str] = []
    real = state.tokenizer

    class Recording:
        def __getattr__(self, name):
            attr = getattr(real, name)
            if name in ("encode", "apply_chat_template"):
                def wrapped(*args, **kwargs):
                    seen.append(threading.current_thread().name)
                    return attr(*args, **kwargs)
                return wrapped
            return attr

    state.tokenizer = Recording()
    try:
        assert client.post("/v1/completions", headers=AUTH, json={"prompt": "hello", "max_tokens": 1}).status_code == 200
        assert client.post("/v1/chat/completions", headers=AUTH, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).status_code == 200
        assert client.post("/tokenize", headers=AUTH, json={"prompt": "hello"}).status_code == 200
    finally:
        state.tokenizer = real
    assert len(seen) >= 4 and all(name.startswith("kvpool-tokenize") for name in seen), seen


def test_a_request_the_engine_fails_alone_gets_an_error_and_the_next_one_is_served(inprocess, monkeypatch):
    """The engine reports a request whose own sampling failed as finished with `.error`: its
    client gets an OpenAI-style error, not a normal-looking finish, and the server carries on."""
    import kvpool.engine.sample_rows as engine_module

    client, _ = inprocess
    real = engine_module.sample

    def picky(logits, params, *rest):
        if any(p.temperature == 0.123 for p in params):
            raise ValueError("cannot sample this row")
        return real(logits, params, *rest)

    monkeypatch.setattr(engine_module, "sample", picky)
    bad = client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2, "temperature": 0.123})
    assert bad.status_code >= 500 and "cannot sample this row" in bad.json()["error"]["message"]
    good = client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
