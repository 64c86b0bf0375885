"""Every error the server returns, mapped to an HTTP status in one table, in OpenAI's body shape."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool.errors import InvalidRequest, KVPoolError, Overloaded

logger = logging.getLogger(__name__)


class ModelNotFound(InvalidRequest):
    """The request names a model this server does not serve."""


class Unauthenticated(KVPoolError):
    """The API key is missing or wrong."""


class ShuttingDown(Overloaded):
    """The server is draining for shutdown and takes no new requests."""


class RequestTooLarge(InvalidRequest):
    """The request body is larger than --max-request-bytes."""


class UpstreamFailed(KVPoolError):
    """A server this one relays to failed while serving the request (the conductor's instances)."""


class NoUpstream(KVPoolError):
    """No server this one relays to can take the request now."""


# most specific first: (exception type, HTTP status, OpenAI error type, code)
_TABLE: list[tuple[type[Exception], int, str, str | None]] = [
    (ModelNotFound, 404, "not_found_error", "model_not_found"),
    (RequestTooLarge, 413, "invalid_request_error", "request_too_large"),
    (Unauthenticated, 401, "authentication_error", "invalid_api_key"),
    (ShuttingDown, 503, "service_unavailable", "shutting_down"),
    (Overloaded, 429, "rate_limit_error", "server_overloaded"),
    (InvalidRequest, 400, "invalid_request_error", None),
    (UpstreamFailed, 502, "upstream_error", "instance_failed"),
    (NoUpstream, 503, "service_unavailable", "no_instance"),
    (KVPoolError, 500, "internal_error", None),
]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def classify(exc: Exception) -> tuple[int, dict, dict[str, str]]:
    """HTTP status, JSON body and extra headers for any exception."""
    for cls, status, type_, code in _TABLE:
        if isinstance(exc, cls):
            headers = {}
            if isinstance(exc, Overloaded):
                headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
            if isinstance(exc, NoUpstream):
                headers["Retry-After"] = "1"
            if isinstance(exc, Unauthenticated):
                headers["WWW-Authenticate"] = "Bearer"
            return status, error_body(str(exc), type_, getattr(exc, "param", None), code), headers
    return 500, error_body("internal server error", "internal_error"), {}


def error_response(exc: Exception) -> JSONResponse:
    status, body, headers = classify(exc)
    if status >= 500 and not isinstance(exc, ShuttingDown):
        logger.exception("request failed", exc_info=exc)
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_param(err: dict) -> str | None:
    """The top-level field (the part of `loc` a client can act on; the rest names union arms)."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    return loc[0] if loc else None


def install_handlers(app: FastAPI) -> None:
    """Turn validation failures, unknown routes and kvpool errors into OpenAI-style bodies."""

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _validation_param(first)
        if first.get("type") == "json_invalid":
            message = f"request body is not valid JSON: {first.get('msg', '')}"
            param = None
        else:
            message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                                f"{e.get('msg', '')}" for e in errors[:5])
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return JSONResponse(error_body(message, type_), status_code=exc.status_code, headers=exc.headers)

    async def on_kvpool(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(KVPoolError, on_kvpool)
    app.add_exception_handler(Exception, on_kvpool)
