"""The server's ASGI middlewares, outermost first: metrics, bearer-token auth, body limit.

Invariants: metrics see every answer (401 and 413 included) and label it by route template; auth
runs before any body is read, and records the tenant in ``scope["kvbaton.tenant"]``; an endpoint
only ever sees a whole body of at most ``max_bytes``, read as JSON, nested at most ``max_depth``
levels (checked without recursion before anything parses it: deeper JSON would exhaust the parsers'
recursion), with no lone UTF-16 surrogate; a refused body is answered on a connection that stays open.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvbaton import serverconf as conf
from kvbaton.errors import InvalidRequest, KvbatonError, PayloadTooLarge, ServerError, Unauthorized
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .delivery import CLIENT_CLOSED, gone
from .sse import ClientGone
from .errors import RETRY_AFTER_S, Health, error_body, unavailable
from .grammar import grammar_failure
from .metrics import Metrics
from .tenancy import SINGLE_TENANT

log = logging.getLogger(__name__)


async def _send_error(send: Send, exc: KvbatonError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer with ``exc`` before the app runs (the app's exception handlers are not reachable here)."""
    body = json.dumps(error_body(exc.code, exc.message, exc.status, exc.param)).encode()
    await send({
        "type": "http.response.start",
        "status": exc.status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": body})


class _HttpMiddleware:
    """An ASGI middleware of HTTP requests; anything else (lifespan events) goes straight to the app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class AnsweredMiddleware(_HttpMiddleware):
    """Runs the request, then ``answered(scope, status, seconds)`` whatever happened: the one place
    that watches a request's status and duration. Without an answer the status is 499 when the
    client left first (a stalled body, a client timeout: its own doing, :mod:`.delivery`), else 500."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        status: int | None = None
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if status is None:
                status = CLIENT_CLOSED if gone(scope) else 500
            self.answered(scope, status, time.perf_counter() - start)

    def answered(self, scope: Scope, status: int, seconds: float) -> None:
        raise NotImplementedError


class ErrorMiddleware(_HttpMiddleware):
    """The innermost middleware: an exception no handler turned into an answer (a server bug, or a
    failure while the engine cannot serve) is logged once, with its traceback, and answered with the
    error schema, 503 ``server_unavailable`` while the engine says it cannot serve, else 500; the
    request then ends as any other, so the connection stays open and the access log and metrics see
    the status the client got. (Starlette's own last-resort handler re-raises, which drops the
    connection and counts a 500.) After the answer started, nothing can be said: it re-raises."""

    def __init__(self, app: ASGIApp, healthy: Health | None = None) -> None:
        super().__init__(app)
        self.healthy = healthy

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except ClientGone:
            return  # nobody to answer: the request's generations were stopped and what they made released
        except Exception as exc:
            if started:
                raise
            bad = grammar_failure(exc)
            if bad is not None:  # the request's schema, not the server: a 400
                await _send_error(send, bad)
                return
            down = unavailable(exc, self.healthy)
            if down is None:
                log.exception("internal error on %s %s", scope.get("method", ""), printable_path(scope))
                down = ServerError(f"internal server error ({type(exc).__name__})")
            else:
                log.warning("%s %s answered 503: %s (%s)", scope.get("method", ""), printable_path(scope),
                            down.message, type(exc).__name__)
            await _send_error(send, down, [(b"retry-after", RETRY_AFTER_S.encode())] if down.status == 503 else ())


# C0 and C1 controls (U+0085 is a line break to many readers) and the Unicode line and paragraph
# separators: every character that str.splitlines, a terminal or a log shipper may take for a line break.
_CONTROL = ({c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}
            | {c: f"\\u{c:04x}" for c in (0x2028, 0x2029)} | {ord("\\"): "\\\\"})


def printable(text: str) -> str:
    """``text`` with its control characters, line separators (and backslashes) escaped: a log line
    stays one line (a ``%0A``, ``%C2%85`` or ``%E2%80%A8`` in a URL, decoded into the path, cannot
    start a forged one)."""
    return text.translate(_CONTROL)


def printable_path(scope: Scope) -> str:
    return printable(str(scope.get("path", "")))


class MetricsMiddleware(AnsweredMiddleware):
    """Counts every request by route template (not raw path: bounded label values) and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    def answered(self, scope: Scope, status: int, seconds: float) -> None:
        route = scope.get("route")
        endpoint = getattr(route, "path", None) or "unmatched"
        self.metrics.answered(scope.get("kvbaton.tenant"), endpoint, scope.get("method", ""), status, seconds)


class AuthMiddleware(_HttpMiddleware):
    """Bearer-token check; records the request's tenant in ``scope["kvbaton.tenant"]``. An ``admin``
    token is no tenant: it is accepted on the ``ADMIN_PATHS`` only (``scope["kvbaton.admin"]``), and
    once there is one, those paths need a token even on a server without tenants."""

    ADMIN_PATHS = frozenset({"/metrics"})

    def __init__(self, app: ASGIApp, tenants: Mapping[str, str], public: frozenset[str] = frozenset(),
                 admin: Sequence[str] = ()) -> None:
        super().__init__(app)
        self.tenants = dict(tenants)
        self.public = public  # exact paths served to anyone: pages that hold no data (the dashboard's)
        self.admin = list(admin)

    @staticmethod
    def _bearer(scope: Scope) -> str | None:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return token.strip() if scheme.lower() == "bearer" else None
        return None

    def _tenant(self, scope: Scope) -> str | None:
        if not self.tenants:
            return SINGLE_TENANT
        token = self._bearer(scope)
        if token is None:
            return None
        found = None
        for known, tenant in self.tenants.items():  # constant time per token
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenant
        return found

    def _is_admin(self, scope: Scope) -> bool:
        token = self._bearer(scope)
        found = False
        for admin in self.admin:  # constant time per token
            found |= token is not None and hmac.compare_digest(admin.encode(), token.encode())
        return found

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("path") in self.public and scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        if self.admin and scope.get("path") in self.ADMIN_PATHS:
            if self._is_admin(scope):
                scope["kvbaton.admin"] = True
                await self.app(scope, receive, send)
                return
            if not self.tenants:  # no tenant to show its own view to: the admin's alone
                await _send_error(send, Unauthorized("this route needs the admin token (Authorization: Bearer "
                                                     "<admin token>)"), [(b"www-authenticate", b"Bearer")])
                return
        tenant = self._tenant(scope)
        if tenant is None:
            await _send_error(send, Unauthorized("missing or invalid bearer token (Authorization: Bearer <token>)"),
                              [(b"www-authenticate", b"Bearer")])
            return
        scope["kvbaton.tenant"] = tenant
        await self.app(scope, receive, send)


_DRAIN_BYTES = 64 * 1024 * 1024
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # high (D800-DBFF) or low (DC00-DFFF)


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(data: bytes) -> int:
    """How deeply the arrays and objects of JSON text nest, without parsing (or recursing): string
    literals are cut out, then the brackets left are summed in C (``accumulate``)."""
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


class BodyLimitMiddleware(_HttpMiddleware):
    """Reads the whole body up front: 413 beyond ``max_bytes``, 400 for JSON nested deeper than
    ``max_depth``, for a body that is not UTF-8 (a UTF-16 one) and for JSON text that is not Unicode
    (lone UTF-16 surrogate escapes, high or low)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int = conf.MAX_JSON_DEPTH) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        too_large = f"request body exceeds the server's limit of {self.max_bytes} bytes"
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await _send_error(send, InvalidRequest("invalid Content-Length header"))
                    return
                if length > self.max_bytes:
                    await self._refuse(receive, send, too_large, drain=length <= _DRAIN_BYTES)
                    return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                more = message.get("more_body", False)
                await self._refuse(receive, send, too_large, drain=more)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        data = b"".join(chunks)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:  # JSON is UTF-8 (RFC 8259); a UTF-16 body is refused, not guessed at
            await _send_error(send, InvalidRequest(
                f"The request body is not UTF-8 (invalid byte at position {exc.start}): send JSON as UTF-8."))
            return
        if json_depth(data) > self.max_depth:
            await _send_error(send, InvalidRequest(
                f"request JSON nests deeper than the server's limit of {self.max_depth} levels"))
            return
        if _SURROGATE_ESCAPE.search(data):
            try:
                lone = _has_lone_surrogate(json.loads(data))
            except ValueError:
                lone = False  # not JSON: the endpoint reports it
            if lone:
                await _send_error(send, InvalidRequest(
                    "The request text contains a lone UTF-16 surrogate escape (\\uD800-\\uDFFF without its pair), "
                    "which is no Unicode text."))
                return
        if data:  # every endpoint takes JSON: read it as JSON whatever the client declared (curl -d)
            headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
            scope["headers"] = [*headers, (b"content-type", b"application/json")]  # in place: metrics read the route
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(receive: Receive, send: Send, message: str, drain: bool) -> None:
        """413. A client still sending would see a reset instead of the answer if the server closed
        on unread data, so read (and drop) what it sends, up to a bound, first."""
        drained = 0
        while drain and drained <= _DRAIN_BYTES:
            event = await receive()
            if event["type"] == "http.disconnect":
                return
            drained += len(event.get("body", b""))
            if not event.get("more_body", False):
                break
        await _send_error(send, PayloadTooLarge(message), [(b"connection", b"close")])
