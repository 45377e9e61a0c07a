"""The server's one error schema: ``{"error": {"code", "message", "type", "param"}}``.

Owns the JSON error body, the exception handlers that answer every failure with it, and the
OpenAPI description of error answers. The body is the shape OpenAI clients parse (``type`` from the
status, ``param`` the request field at fault or null), with kvbaton's own ``code``. Invariants: an
SDK error answers with its class's ``status`` (``kvbaton.errors``), so the status of a code is
written in one place; the only codes without an exception class are the router's own
(``not_found``, ``method_not_allowed``); on the OpenAI routes a code with an OpenAI name
(``OPENAI_CODES``: ``context_length_exceeded``) answers with that name; a server-side failure while
the engine says it cannot serve (every worker down) is 503 ``server_unavailable``, not 500;
capacity answers (503) carry ``Retry-After``, a quota (429) ``x-should-retry: false``.
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
    OPENAI_CODES,
    InvalidRequest,
    KvbatonError,
    PayloadTooLarge,
    PoolExhausted,
    QuotaExceeded,
    ServerError,
    ServerUnavailable,
    Unauthorized,
)
from kvbaton.wire import invalid_request
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as p
from .grammar import grammar_failure

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


OPENAI_PATH_PREFIXES = ("/v1/chat/", "/v1/completions", "/v1/responses", "/v1/models")


def error_type(status: int) -> str:
    """OpenAI's error ``type``, which is not by status: ``invalid_request_error`` for what the request
    did wrong (a bad field, an unknown model or key, 401 and 404 included), ``insufficient_quota``
    for a quota that retrying cannot lift (429, with ``x-should-retry: false``), ``server_error`` for
    the server's own failures (5xx). (OpenAI's clients raise their exception classes by status.)"""
    if status >= 500:
        return "server_error"
    return "insufficient_quota" if status == 429 else "invalid_request_error"


def error_body(code: str, message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "type": error_type(status), "param": param}}


def openai_code(code: str, path: str) -> str:
    """The code a route answers with: OpenAI's name of it on the OpenAI routes, else kvbaton's."""
    return OPENAI_CODES.get(code, code) if path.startswith(OPENAI_PATH_PREFIXES) else code


def error_response(code: str, message: str, status: int, headers: dict[str, str] | None = None,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message, status, param), status_code=status, headers=headers)


def retry_headers(exc: KvbatonError) -> dict[str, str] | None:
    """What tells a client whether to retry: ``Retry-After`` on a transient 503 (a full pool, an engine
    that cannot serve now), ``x-should-retry: false`` on a quota (429: retrying does not help until
    the tenant releases handles; OpenAI's clients, which retry every 429, honour the header)."""
    if isinstance(exc, PoolExhausted | ServerUnavailable):
        return {"Retry-After": RETRY_AFTER_S}
    if isinstance(exc, QuotaExceeded):
        return {"x-should-retry": "false"}
    return None


def exception_response(exc: KvbatonError, path: str = "") -> JSONResponse:
    headers = retry_headers(exc)
    return error_response(openai_code(exc.code, path), exc.message, exc.status, headers=headers,
                          param=getattr(exc, "param", None))


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
    exc = grammar_failure(exc) or unavailable(exc, healthy) or exc
    if isinstance(exc, KvbatonError):
        return error_body(exc.code, exc.message, exc.status, getattr(exc, "param", None))
    log.exception("stream failed", exc_info=exc)
    return error_body(ServerError.code, type(exc).__name__, ServerError.status)


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
    """Answer every failure the request's handling raises on purpose with the error schema;
    ``healthy`` turns server failures into 503 while the engine cannot serve. (Any other exception:
    ``middleware.ErrorMiddleware``.)"""

    @app.exception_handler(KvbatonError)
    async def kvbaton_error(request: Request, exc: KvbatonError) -> JSONResponse:
        return exception_response(unavailable(exc, healthy) or exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return exception_response(invalid_request(exc.errors()), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _ROUTER_CODES.get(exc.status_code, InvalidRequest.code if exc.status_code < 500 else ServerError.code)
        return error_response(code, str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None))


# OpenAPI: every status a request can be answered with by an SDK error (5xx internal errors aside).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": p.ErrorBody}
    for status in sorted({cls.status for cls in ERRORS_BY_CODE.values() if cls.status != ServerError.status})
}
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    200: {"content": {"text/event-stream": {}}, "description": "Result, or server-sent events with `stream: true`."},
}


def stream_responses(whole: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI answers of a route that answers ``whole`` (JSON), or with ``stream: true`` server-sent
    events whose ``data`` are ``chunk``s (then ``[DONE]``), and the error schema."""
    return {**ERROR_RESPONSES, 200: {
        "model": whole, "content": {"text/event-stream": {"schema": {"type": "string", "description": (
            f"With `stream: true`: `data: <{chunk.__name__}>` events, then `data: [DONE]`.")}}},
        "description": f"A `{whole.__name__}`, or with `stream: true` server-sent events of `{chunk.__name__}`s."}}
