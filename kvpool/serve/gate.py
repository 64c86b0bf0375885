"""ASGI middleware in front of every route: the key check, a body-size limit and the shutdown drain.

`KeyGate` answers 401 before routing to a request without a key this server knows (so unknown
paths and redirects tell nothing without a key); the routes then check the key each needs.
`QuietDisconnect` keeps a client's hang-up on a non-streaming request (which cancels its work) out
of the error log: one debug line instead of an ASGI traceback.

`BodyLimit` answers 413 for a declared Content-Length over the limit without reading the body,
and for a body that grows past the limit while it arrives (chunked, or a lying Content-Length);
a body within the limit is buffered and replayed to the app. `DrainGate` answers 503 to every
new request while the server drains for shutdown (the listener stays open, so clients get an
answer instead of a refused connection); in-flight requests are not affected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from kvpool.serve.auth import KeyRing, bearer_token
from kvpool.serve.errors import RequestTooLarge, ShuttingDown, Unauthenticated, classify

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024

logger = logging.getLogger(__name__)


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


class KeyGate:
    """With API keys configured: 401 for every path but `open_paths` unless the request carries a
    key of `keys` (without keys every route is open, and so is every path)."""

    def __init__(self, app: ASGIApp, keys: KeyRing, open_paths: frozenset[str]) -> None:
        self.app, self.keys, self.open_paths = app, keys, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and not self.keys.open and scope.get("path") not in self.open_paths
                and not self.keys.recognises(bearer_token(Headers(scope=scope).get("authorization")))):
            await _error(Unauthenticated("missing or invalid API key (send Authorization: Bearer <key>)"))(
                scope, receive, send)
            return
        await self.app(scope, receive, send)


class QuietDisconnect:
    """`unless_disconnected` raises CancelledError when the client of a non-streaming request hangs
    up (its engine requests are aborted then): normal traffic, logged once at debug level. A real
    cancellation of the task (the server stopping) is re-raised."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if scope["type"] != "http" or (task is not None and task.cancelling()):
                raise
            logger.debug("client disconnected before the response: %s %s", scope.get("method"), scope.get("path"))


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
