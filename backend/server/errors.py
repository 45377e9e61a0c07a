"""The server's one error schema: ``{"error": {"code": ..., "message": ...}}``.

Owns the JSON error body, the exception handlers that answer every failure with it, and the
OpenAPI description of error answers. Invariants: an SDK error answers with its class's ``status``
(``kvbaton.errors``), so the status of a code is written in one place; the only codes without an
exception class are the router's own (``not_found``, ``method_not_allowed``); a server-side failure
while the engine says it cannot serve (every worker down) is 503 ``server_unavailable``, not 500;
capacity answers (503) carry ``Retry-After``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kvbaton.errors import (
    ERRORS_BY_CODE,
    InvalidRequest,
    KvbatonError,
    PayloadTooLarge,
    PoolExhausted,
    ServerError,
    ServerUnavailable,
    Unauthorized,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import protocol as p

log = logging.getLogger(__name__)

T = TypeVar("T")
Health = Callable[[], tuple[bool, str]]  # whether the engine can serve, and why (not)
RETRY_AFTER_S = "1"

# Codes of router answers that no SDK exception stands for, by HTTP status.
_ROUTER_CODES: dict[int, str] = {
    404: "not_found",
    405: "method_not_allowed",
    PayloadTooLarge.status: PayloadTooLarge.code,
    Unauthorized.status: Unauthorized.code,
}


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def error_response(code: str, message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


def exception_response(exc: KvbatonError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if isinstance(exc, PoolExhausted | ServerUnavailable) else None
    return error_response(exc.code, exc.message, exc.status, headers=headers)


def unavailable(exc: BaseException, healthy: Health | None) -> ServerUnavailable | None:
    """``ServerUnavailable`` when ``exc`` is the server's failure (5xx, or no SDK error) and the
    engine says it cannot serve now; None otherwise (the request's own fault stays as it is)."""
    if healthy is None or (isinstance(exc, KvbatonError) and exc.status < 500):
        return None
    try:
        ok, reason = healthy()
    except Exception:  # noqa: BLE001 - a health check that fails says enough
        ok, reason = False, "the engine's health check failed"
    return None if ok else ServerUnavailable(f"the engine cannot serve now: {reason}")


def in_band_error(exc: Exception, healthy: Health | None = None) -> dict[str, Any]:
    """The error body of a failure after a response has started (reported inside the stream)."""
    exc = unavailable(exc, healthy) or exc
    if isinstance(exc, KvbatonError):
        return error_body(exc.code, exc.message)
    log.exception("stream failed", exc_info=exc)
    return error_body(ServerError.code, type(exc).__name__)


def template_errors(fn: Callable[[], T]) -> T:
    """Run a call that renders the chat template: template failures are the request's fault."""
    try:
        return fn()
    except KvbatonError:
        raise
    except (ValueError, TypeError, LookupError) as exc:
        raise InvalidRequest(f"cannot render the chat template for these messages/tools: {exc}") from exc
    except Exception as exc:
        if type(exc).__module__.startswith("jinja2"):
            raise InvalidRequest(f"cannot render the chat template for these messages/tools: {exc}") from exc
        raise


def install_error_handlers(app: FastAPI, healthy: Health | None = None) -> None:
    """Answer every failure with the error schema; ``healthy`` turns server failures into 503 while
    the engine cannot serve."""

    @app.exception_handler(KvbatonError)
    async def kvbaton_error(request: Request, exc: KvbatonError) -> JSONResponse:
        return exception_response(unavailable(exc, healthy) or exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors()[:10]:
            if err.get("type") == "json_invalid":
                where = err.get("loc", ("body", "?"))[-1]
                reason = err.get("ctx", {}).get("error", "JSON decode error")
                problems.append(f"malformed JSON at position {where} ({reason})")
                continue
            loc = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
            problems.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
        return exception_response(InvalidRequest("invalid request: " + "; ".join(problems)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _ROUTER_CODES.get(exc.status_code, InvalidRequest.code if exc.status_code < 500 else ServerError.code)
        return error_response(code, str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        down = unavailable(exc, healthy)
        if down is not None:
            return exception_response(down)
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(ServerError.code, f"internal server error ({type(exc).__name__})", ServerError.status)


# OpenAPI: every status a request can be answered with by an SDK error (5xx internal errors aside).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": p.ErrorBody}
    for status in sorted({cls.status for cls in ERRORS_BY_CODE.values() if cls.status != ServerError.status})
}
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    200: {"content": {"text/event-stream": {}}, "description": "Result, or server-sent events with `stream: true`."},
}
