"""ASGI middleware in front of every route: a body-size limit and the shutdown drain.

`BodyLimit` answers 413 for a declared Content-Length over the limit without reading the body,
and for a body that grows past the limit while it arrives (chunked, or a lying Content-Length);
a body within the limit is buffered and replayed to the app. `DrainGate` answers 503 to every
new request while the server drains for shutdown (the listener stays open, so clients get an
answer instead of a refused connection); in-flight requests are not affected.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import JSONResponse

from kvpool.serve.errors import RequestTooLarge, ShuttingDown, classify

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def _error(exc: Exception) -> JSONResponse:
    status, body, headers = classify(exc)
    return JSONResponse(body, status_code=status, headers={**headers, "Connection": "close"})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> JSONResponse:
        return _error(RequestTooLarge(f"the request body is larger than {self.max_bytes} bytes "
                                      "(the server's --max-request-bytes)"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (not value.isdigit() or int(value) > self.max_bytes):
                await self._too_large()(scope, receive, send)
                return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class DrainGate:
    """`draining()` true: 503 for every path but `passthrough` (e.g. /metrics)."""

    def __init__(self, app: ASGIApp, draining: Callable[[], bool], passthrough: frozenset[str]) -> None:
        self.app, self.draining, self.passthrough = app, draining, passthrough

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.draining() and scope.get("path") not in self.passthrough:
            await _error(ShuttingDown("the server is shutting down; retry on another instance"))(
                scope, receive, send)
            return
        await self.app(scope, receive, send)
