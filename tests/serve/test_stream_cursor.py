"""Pure pieces of the server: streamed text never shows a stop string, and errors map to codes."""

from __future__ import annotations

from kvpool.engine.outputs import CompletionOutput
from kvpool.errors import InvalidRequest, KVPoolError, Overloaded
from kvpool.serve.errors import ModelNotFound, ShuttingDown, Unauthenticated, classify
from kvpool.serve.responses import Cursor, holdback_for


def test_cursor_holds_back_text_that_may_become_a_stop_string():
    cur, hold = Cursor(), holdback_for(["\n\n"])
    d1, _ = cur.advance(CompletionOutput(0, [1, 2], "Hello\n"), hold)
    assert d1 == "Hello"  # the "\n" might start the stop string
    d2, first = cur.advance(CompletionOutput(0, [1, 2, 3], "Hello", "stop", "\n\n"), hold)
    assert d2 == "" and first == 2 and cur.done


def test_cursor_releases_held_text_when_no_stop_follows():
    cur, hold = Cursor(), holdback_for(["END"])
    assert cur.advance(CompletionOutput(0, [1], "abcEN"), hold)[0] == "abc"
    assert cur.advance(CompletionOutput(0, [1, 2], "abcENx", "length"), hold)[0] == "ENx"


def test_every_kvpool_error_maps_to_its_http_status():
    cases = [(InvalidRequest("bad", param="n"), 400), (ModelNotFound("m", param="model"), 404),
             (Unauthenticated("k"), 401), (Overloaded("busy", retry_after_s=2.4), 429),
             (ShuttingDown("bye"), 503), (KVPoolError("x"), 500), (RuntimeError("y"), 500)]
    for exc, status in cases:
        got, body, headers = classify(exc)
        assert got == status and set(body["error"]) == {"message", "type", "param", "code"}
    assert classify(Overloaded("busy", retry_after_s=2.4))[2]["Retry-After"] == "2"
    assert classify(InvalidRequest("bad", param="n"))[1]["error"]["param"] == "n"
