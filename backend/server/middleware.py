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
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvbaton import serverconf as conf
from kvbaton.errors import InvalidRequest, KvbatonError, PayloadTooLarge, Unauthorized
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body
from .metrics import Metrics
from .tenancy import SINGLE_TENANT


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
    """Runs the request, then ``answered(scope, status, seconds)`` whatever happened (status 500 when
    no answer was started): the one place that watches a request's status and duration."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.answered(scope, status, time.perf_counter() - start)

    def answered(self, scope: Scope, status: int, seconds: float) -> None:
        raise NotImplementedError


class MetricsMiddleware(AnsweredMiddleware):
    """Counts every request by route template (not raw path: bounded label values) and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    def answered(self, scope: Scope, status: int, seconds: float) -> None:
        route = scope.get("route")
        endpoint = getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(endpoint, scope.get("method", ""), str(status)).inc()
        self.metrics.duration.labels(endpoint).observe(seconds)


class AuthMiddleware(_HttpMiddleware):
    """Bearer-token check; records the request's tenant in ``scope["kvbaton.tenant"]``."""

    def __init__(self, app: ASGIApp, tenants: Mapping[str, str], public: frozenset[str] = frozenset()) -> None:
        super().__init__(app)
        self.tenants = dict(tenants)
        self.public = public  # exact paths served to anyone: pages that hold no data (the dashboard's)

    def _tenant(self, scope: Scope) -> str | None:
        if not self.tenants:
            return SINGLE_TENANT
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return None
                token = token.strip()
                found = None
                for known, tenant in self.tenants.items():  # constant time per token
                    if hmac.compare_digest(known.encode(), token.encode()):
                        found = tenant
                return found
        return None

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("path") in self.public and scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        if tenant is None:
            await _send_error(send, Unauthorized("missing or invalid bearer token (Authorization: Bearer <token>)"),
                              [(b"www-authenticate", b"Bearer")])
            return
        scope["kvbaton.tenant"] = tenant
        await self.app(scope, receive, send)


_DRAIN_BYTES = 64 * 1024 * 1024
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")


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
    ``max_depth`` and for JSON text that is not Unicode (lone UTF-16 surrogate escapes)."""

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
                await _send_error(send, InvalidRequest("request text contains a lone UTF-16 surrogate"))
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
