"""Pure pieces of the server: errors map to codes. (Held-back stop strings are the engine's:
tests/engine/test_output_processor.py.)"""

from __future__ import annotations

from kvpool.errors import InvalidRequest, KVPoolError, Overloaded
from kvpool.serve.errors import ModelNotFound, ShuttingDown, Unauthenticated, classify


def test_every_kvpool_error_maps_to_its_http_status():
    cases = [(InvalidRequest("bad", param="n"), 400), (ModelNotFound("m", param="model"), 404),
             (Unauthenticated("k"), 401), (Overloaded("busy", retry_after_s=2.4), 429),
             (ShuttingDown("bye"), 503), (KVPoolError("x"), 500), (RuntimeError("y"), 500)]
    for exc, status in cases:
        got, body, headers = classify(exc)
        assert got == status and set(body["error"]) == {"message", "type", "param", "code"}
    assert classify(Overloaded("busy", retry_after_s=2.4))[2]["Retry-After"] == "2"
    assert classify(InvalidRequest("bad", param="n"))[1]["error"]["param"] == "n"
