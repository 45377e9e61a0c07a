"""The kvbaton server: the engine behind HTTP.

``create_app(engine)`` builds the FastAPI app; ``serve(...)`` (``kvbaton serve``) runs it under
uvicorn. Endpoints:

- native handle API under ``/v1/kv/...`` (materialize, extend, fork, resume, complete, generate,
  release, release_all, stats, tokenize, detokenize, chat_tokens); generation streams as
  server-sent events (``event: chunk`` ..., then ``event: result``);
- OpenAI-compatible ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``, with the
  ``kvbaton`` body extension / ``X-Kvbaton-Agent`` header to reuse handles;
- ``/health`` and ``/metrics`` (Prometheus text).

Every error answers ``{"error": {"code": ..., "message": ...}}`` with the SDK's error codes and a 4xx
status for anything the request did wrong. Engine calls block: they run in worker threads, and
streams are pulled one step per worker call, so the event loop never waits on the model.

Security: with tokens configured, every request needs ``Authorization: Bearer <token>``; each token
is a tenant, and handles are visible only to the tenant that made them (any other tenant gets the
same 404 as for an unknown id).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import kvbaton
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvbaton.capabilities import KVBATON as KVBATON_CAPABILITIES
from kvbaton.capabilities import Capabilities
from kvbaton.client import sampling_params
from kvbaton.errors import (
    HandleNotFound,
    HandleReleased,
    InvalidRequest,
    KvbatonError,
    PoolExhausted,
)
from kvbaton.handle import Handle, Segment
from kvbaton.serverconf import (
    DEFAULT_HOST,
    DEFAULT_MAX_AGENTS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_N,
    DEFAULT_OPENAI_MAX_TOKENS,
    DEFAULT_PORT,
    DEFAULT_THREADS,
    check_bind,
)
from kvbaton.stream import TokenStream
from kvbaton.types import Composition, Fidelity, Result, SamplingParams, Stats, StreamChunk
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import protocol as p

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_TOKENS = 4096  # when the model does not say its context
SINGLE_TENANT = "default"
MAX_AGENT_CHARS = 200
_RELEASED_OWNERS = 1_000_000

STATUS_BY_CODE: dict[str, int] = {
    "invalid_request": 400,
    "context_too_long": 400,
    "payload_too_large": 413,
    "handle_not_found": 404,
    "handle_released": 410,
    "incompatible_handle": 409,
    "unsupported_positions": 409,
    "merge_conflict": 409,
    "pool_exhausted": 503,
    "model_not_found": 404,
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "internal_error": 500,
}


def error_response(code: str, message: str, status: int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message}},
        status_code=status or STATUS_BY_CODE.get(code, 400),
        headers=headers,
    )


def tenant_id(token: str) -> str:
    """The tenant a bearer token stands for (a hash: tokens never appear in logs or metrics)."""
    return "t-" + hashlib.sha256(token.encode()).hexdigest()[:16]


# -- tenancy -------------------------------------------------------------------------------------


class Owners:
    """Which tenant made each handle id. A tenant asking about any other id gets ``HandleNotFound``,
    exactly as for an id that never existed; released ids are remembered (bounded) so that their
    owner still gets ``HandleReleased`` from the engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, str] = {}
        self._released: OrderedDict[str, str] = OrderedDict()

    def add(self, tenant: str, handle_ids: Iterable[str]) -> None:
        with self._lock:
            for hid in handle_ids:
                self._live[hid] = tenant

    def check(self, tenant: str, handle_ids: Iterable[str]) -> None:
        with self._lock:
            for hid in handle_ids:
                owner = self._live.get(hid) or self._released.get(hid)
                if owner != tenant:
                    raise HandleNotFound(f"no handle {hid} in this engine")

    def released(self, handle_ids: Iterable[str]) -> None:
        with self._lock:
            for hid in handle_ids:
                owner = self._live.pop(hid, None)
                if owner is not None:
                    self._released[hid] = owner
                    if len(self._released) > _RELEASED_OWNERS:
                        self._released.popitem(last=False)

    def live(self, tenant: str) -> list[str]:
        with self._lock:
            return [hid for hid, owner in self._live.items() if owner == tenant]


@dataclass
class _Slot:
    lock: threading.Lock = field(default_factory=threading.Lock)
    handle_id: str | None = None


class AgentSlots:
    """The latest result handle of each (tenant, agent) of the OpenAI endpoints.

    An agent's next request reuses it (the engine keeps the longest common token prefix), then the
    new result replaces it and the old one is released: a chatting agent holds one handle, not one
    per turn. Least recently used slots are dropped beyond ``max_slots`` or when the pool is full.
    """

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self._lock = threading.Lock()
        self._slots: OrderedDict[tuple[str, str], _Slot] = OrderedDict()

    def slot(self, key: tuple[str, str]) -> _Slot:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
            self._slots.move_to_end(key)
            return slot

    def oldest_idle(self, exclude: tuple[str, str] | None = None) -> tuple[tuple[str, str], _Slot] | None:
        with self._lock:
            for key, slot in self._slots.items():
                if key != exclude and slot.handle_id is not None and not slot.lock.locked():
                    return key, slot
            return None

    def overflow(self) -> list[tuple[tuple[str, str], _Slot]]:
        with self._lock:
            out = []
            for key in list(self._slots):
                if len(self._slots) <= self.max_slots:
                    break
                slot = self._slots[key]
                if not slot.lock.locked():
                    out.append((key, self._slots.pop(key)))
            return out

    def forget(self, handle_ids: set[str]) -> None:
        with self._lock:
            for slot in self._slots.values():
                if slot.handle_id in handle_ids:
                    slot.handle_id = None

    def tenant_slots(self, tenant: str) -> list[_Slot]:
        with self._lock:
            return [slot for (t, _), slot in self._slots.items() if t == tenant]


# -- metrics -------------------------------------------------------------------------------------

class Metrics:
    def __init__(self, stats: Callable[[], Stats]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvbaton_requests", "HTTP requests by endpoint, method and status", ["endpoint", "method", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvbaton_request_duration_seconds", "HTTP request duration (streams: until the last byte)",
            ["endpoint"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.ttft = Histogram(
            "kvbaton_ttft_seconds", "Time to first token of generation requests, measured in the engine",
            ["endpoint"], registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30),
        )
        self.prompt_tokens = Counter(
            "kvbaton_prompt_tokens", "Prompt tokens of generation requests: reused from a handle or prefilled",
            ["endpoint", "source"], registry=self.registry,
        )
        self.generated_tokens = Counter(
            "kvbaton_generated_tokens", "Generated tokens", ["endpoint"], registry=self.registry
        )
        self.registry.register(_PoolCollector(stats))

    def observe(self, endpoint: str, result: Result) -> None:
        t = result.timings
        self.ttft.labels(endpoint).observe(t.ttft_s)
        self.prompt_tokens.labels(endpoint, "reused").inc(t.tokens_reused)
        self.prompt_tokens.labels(endpoint, "prefilled").inc(t.tokens_prefilled)
        self.generated_tokens.labels(endpoint).inc(t.tokens_generated)


class _PoolCollector:
    """Pool usage and the engine's own reuse counters, read at scrape time."""

    def __init__(self, stats: Callable[[], Stats]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        s = self._stats()
        blocks = GaugeMetricFamily("kvbaton_pool_blocks", "KV pool blocks by state", labels=["state"])
        for state, value in (("total", s.blocks_total), ("used", s.blocks_used), ("free", s.blocks_free),
                             ("shared", s.blocks_shared)):
            blocks.add_metric([state], value)
        yield blocks
        nbytes = GaugeMetricFamily("kvbaton_pool_bytes", "KV pool bytes by state", labels=["state"])
        for state, value in (("total", s.pool_bytes_total), ("used", s.pool_bytes_used), ("free", s.pool_bytes_free)):
            nbytes.add_metric([state], value)
        yield nbytes
        yield GaugeMetricFamily("kvbaton_handles_live", "Live handles in the engine", value=s.handles_live)
        tokens = CounterMetricFamily(
            "kvbaton_engine_tokens", "Engine token counters: prompt tokens reused from handles, prefilled, generated",
            labels=["kind"],
        )
        for kind, value in (("reused", s.tokens_reused), ("prefilled", s.tokens_prefilled),
                            ("generated", s.tokens_generated)):
            tokens.add_metric([kind], value)
        yield tokens


# -- ASGI middleware ---------------------------------------------------------------------------


async def _send_error(send: Send, status: int, code: str, message: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": body})


class MetricsMiddleware:
    """Counts every request by route template (not raw path: bounded label values) and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(endpoint, scope.get("method", ""), str(status)).inc()
            self.metrics.duration.labels(endpoint).observe(time.perf_counter() - start)


class AuthMiddleware:
    """Bearer-token check; records the request's tenant in ``scope["kvbaton.tenant"]``."""

    def __init__(self, app: ASGIApp, tenants: Mapping[str, str]) -> None:
        self.app = app
        self.tenants = dict(tenants)

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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        if tenant is None:
            await _send_error(send, 401, "unauthorized", "missing or invalid bearer token (Authorization: Bearer <token>)",
                              [(b"www-authenticate", b"Bearer")])
            return
        scope["kvbaton.tenant"] = tenant
        await self.app(scope, receive, send)


_DRAIN_BYTES = 64 * 1024 * 1024
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")


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


class BodyLimitMiddleware:
    """Reads the whole body up front: 413 beyond ``max_bytes``, 400 for JSON text that is not
    Unicode (lone UTF-16 surrogate escapes)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = f"request body exceeds the server's limit of {self.max_bytes} bytes"
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await _send_error(send, 400, "invalid_request", "invalid Content-Length header")
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
        if _SURROGATE_ESCAPE.search(data):
            try:
                lone = _has_lone_surrogate(json.loads(data))
            except ValueError:
                lone = False  # not JSON: the endpoint reports it
            if lone:
                await _send_error(send, 400, "invalid_request", "request text contains a lone UTF-16 surrogate")
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
        await _send_error(send, 413, "payload_too_large", message, [(b"connection", b"close")])


# -- the application -----------------------------------------------------------------------------


class EventStreamResponse(StreamingResponse):
    """SSE response whose event generator is always closed (so the engine request is cancelled),
    also when the client goes away mid-stream."""

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        super().__init__(
            events, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def _sse(data: str, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return head + "".join(f"data: {line}\n" for line in data.split("\n")) + "\n"


_END = object()


class ServerState:
    """Everything the endpoints share: the client over the engine, tenancy, limits, metrics."""

    def __init__(
        self,
        engine: Any,
        *,
        tenants: Mapping[str, str],
        max_tokens: int,
        default_max_tokens: int,
        max_n: int,
        max_agents: int,
        threads: int,
    ) -> None:
        self.engine = engine
        self.tenants = tenants
        self.multi_tenant = bool(tenants)
        self.max_tokens = max_tokens
        self.default_max_tokens = default_max_tokens
        self.max_n = max_n
        self.threads = threads
        self.owners = Owners()
        self.slots = AgentSlots(max_agents)
        self.model = engine.stats().model
        self.max_context: int | None = getattr(getattr(engine, "loaded", None), "max_context", None)
        self.metrics = Metrics(engine.stats)
        self._hints_lock = threading.Lock()
        self._hints: dict[str, dict[str, float]] = {}  # tenant -> {engine agent name: steps}
        self._limiter: anyio.CapacityLimiter | None = None

    # -- threads ------------------------------------------------------------------------------
    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self._limiter)

    # -- handles and tenancy --------------------------------------------------------------------
    def check_owned(self, tenant: str, refs: Iterable[p.HandleRef]) -> None:
        if self.multi_tenant:
            self.owners.check(tenant, [_ref_id(r) for r in refs])

    def record(self, tenant: str, handles: Iterable[Handle]) -> None:
        self.owners.add(tenant, [h.id for h in handles])

    def release(self, tenant: str, refs: Sequence[p.HandleRef]) -> None:
        self.check_owned(tenant, refs)
        self.engine.release(list(refs))
        ids = {_ref_id(r) for r in refs}
        self.owners.released(ids)
        self.slots.forget(ids)

    def release_quietly(self, handle_ids: Iterable[str]) -> None:
        for hid in handle_ids:
            try:
                self.engine.release(hid)
            except (HandleNotFound, HandleReleased):
                pass
            self.owners.released([hid])

    # -- agents -------------------------------------------------------------------------------
    def agent(self, tenant: str, agent: str | None) -> str | None:
        """The engine's name of a tenant's agent: tenants share the engine, not agent names."""
        if not agent:
            return None
        if len(agent) > MAX_AGENT_CHARS:
            raise InvalidRequest(f"agent names are at most {MAX_AGENT_CHARS} characters")
        return f"{tenant}/{agent}" if self.multi_tenant else agent

    def agent_of(self, tenant: str, engine_name: str) -> str | None:
        """The tenant's own name of an engine agent name, or None for another tenant's agent."""
        if not self.multi_tenant:
            return engine_name
        prefix = f"{tenant}/"
        return engine_name[len(prefix):] if engine_name.startswith(prefix) else None

    def stats(self, tenant: str) -> Stats:
        stats = self.engine.stats()
        agents = getattr(stats, "agents", None)
        if self.multi_tenant and agents:
            own = {}
            for name, value in agents.items():
                mine = self.agent_of(tenant, name)
                if mine is not None:
                    own[mine] = value
            stats = stats.model_copy(update={"agents": own})
        return stats

    def hints(self, tenant: str, steps: dict[str, float], running: Sequence[str]) -> dict[str, float]:
        """Set the tenant's steps-to-execution; the engine gets every tenant's hints together."""
        mine = {self.agent(tenant, a) or "": float(v) for a, v in steps.items()}
        for a in running:
            mine[self.agent(tenant, a) or ""] = 0.0
        mine.pop("", None)
        with self._hints_lock:
            merged = {a: v for t, hs in self._hints.items() if t != tenant for a, v in hs.items()}
            merged.update(mine)
            result = self.engine.hints(merged)
            self._hints[tenant] = mine
        return {own: v for a, v in result.items() if (own := self.agent_of(tenant, a)) is not None}

    def sampling(self, fields: dict[str, Any]) -> SamplingParams:
        params = sampling_params(None, fields)
        if params.max_tokens > self.max_tokens:
            raise InvalidRequest(f"max_tokens {params.max_tokens} exceeds the server's limit of {self.max_tokens}")
        return params


def _ref_id(ref: p.HandleRef) -> str:
    return ref.id if isinstance(ref, Handle) else ref


def _template_errors(fn: Callable[[], T]) -> T:
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


def _prime(stream: TokenStream) -> StreamChunk | None:
    """Run a fresh stream up to its first chunk, so that admission errors (pool exhausted) surface
    before the response starts."""
    chunk = next(stream, None)
    return chunk


def _tenant(request: Request) -> str:
    return request.scope.get("kvbaton.tenant", SINGLE_TENANT)


def create_app(
    target: Any,
    *,
    token: str | Sequence[str] | Mapping[str, str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_tokens: int | None = None,
    default_max_tokens: int = DEFAULT_OPENAI_MAX_TOKENS,
    max_n: int = DEFAULT_MAX_N,
    max_agents: int = DEFAULT_MAX_AGENTS,
    threads: int = DEFAULT_THREADS,
) -> FastAPI:
    """The FastAPI app around ``target``: a :class:`kvbaton.backend.Engine` or an ``EmbeddedClient``.

    ``token``: one bearer token, several (each its own tenant), or a ``{token: tenant_name}`` map;
    ``None`` (or empty) serves without authentication, everything in one tenant.
    ``max_tokens`` caps ``max_tokens`` of every request (default: the model's context);
    ``default_max_tokens`` applies to OpenAI requests that give none.
    """
    engine = getattr(target, "engine", target)  # an EmbeddedClient's engine, or the engine itself
    if not all(hasattr(engine, m) for m in ("materialize", "resume_stream", "generate_stream", "release", "stats")):
        raise TypeError(f"create_app needs a kvbaton Engine or EmbeddedClient, got {type(target).__name__}")
    tenants = _tenant_map(token)
    state = ServerState(
        engine,
        tenants=tenants,
        max_tokens=0,
        default_max_tokens=default_max_tokens,
        max_n=max_n,
        max_agents=max_agents,
        threads=threads,
    )
    state.max_tokens = max_tokens or state.max_context or DEFAULT_MAX_TOKENS
    state.default_max_tokens = min(default_max_tokens, state.max_tokens)

    app = FastAPI(
        title="kvbaton",
        version=kvbaton.__version__,
        description="Pass KV-cache handles instead of text between LLM agents.",
    )
    app.state.kvbaton = state
    _install_error_handlers(app)
    _add_native_routes(app, state)
    _add_openai_routes(app, state)

    @app.get("/health", response_model=p.Health, tags=["server"])
    async def health() -> p.Health:
        return p.Health(model=state.model, version=kvbaton.__version__)

    @app.get("/v1/capabilities", response_model=Capabilities, tags=["server"], responses=_ERROR_RESPONSES)
    async def capabilities() -> Capabilities:
        """What the engine behind this server does exactly, corrects, recomputes or cannot do."""
        describe = getattr(state.engine, "capabilities", None)
        return describe() if describe is not None else KVBATON_CAPABILITIES

    @app.get("/metrics", tags=["server"], response_class=Response)
    async def metrics() -> Response:
        body = await state.run(generate_latest, state.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # Outermost first: metrics see every answer (401 and 413 included), auth runs before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(AuthMiddleware, tenants=tenants)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    return app


def _tenant_map(token: str | Sequence[str] | Mapping[str, str] | None) -> dict[str, str]:
    if not token:
        return {}
    if isinstance(token, str):
        tokens: dict[str, str] = {token: tenant_id(token)}
    elif isinstance(token, Mapping):
        tokens = {str(k): str(v) for k, v in token.items()}
    else:
        tokens = {t: tenant_id(t) for t in token}
    if any(not t or t != t.strip() or any(c.isspace() for c in t) for t in tokens):
        raise InvalidRequest("tokens must be non-empty and contain no whitespace")
    return tokens


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KvbatonError)
    async def kvbaton_error(request: Request, exc: KvbatonError) -> JSONResponse:
        headers = {"Retry-After": "1"} if isinstance(exc, PoolExhausted) else None
        return error_response(exc.code, exc.message, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors()[:10]:
            if err.get("type") == "json_invalid":
                where = err.get("loc", ("body", "?"))[-1]
                problems.append(f"malformed JSON at position {where} ({err.get('ctx', {}).get('error', 'JSON decode error')})")
                continue
            loc = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
            problems.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
        return error_response("invalid_request", "invalid request: " + "; ".join(problems))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 401: "unauthorized"}.get(
            exc.status_code, "invalid_request" if exc.status_code < 500 else "internal_error"
        )
        return error_response(code, str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response("internal_error", f"internal server error ({type(exc).__name__})", 500)


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": p.ErrorBody} for status in (400, 401, 404, 409, 410, 413, 503)
}
_STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_ERROR_RESPONSES,
    200: {"content": {"text/event-stream": {}}, "description": "Result, or server-sent events with `stream: true`."},
}


# -- native API ----------------------------------------------------------------------------------


def _agent_of(request: Request, body_agent: str | None) -> str | None:
    """The request's agent tag: the body's ``agent`` field, else the ``X-Kvbaton-Agent`` header."""
    return body_agent if body_agent is not None else request.headers.get("x-kvbaton-agent") or None


def _add_native_routes(app: FastAPI, state: ServerState) -> None:
    kv = {"tags": ["native"], "responses": _ERROR_RESPONSES}
    engine = state.engine

    @app.post("/v1/kv/materialize", response_model=Handle, **kv)
    async def materialize(body: p.MaterializeRequest, request: Request) -> Handle:
        tenant = _tenant(request)
        agent = state.agent(tenant, _agent_of(request, body.agent))
        handle = await state.run(engine.materialize, body.context, agent=agent)
        state.record(tenant, [handle])
        return handle

    @app.post("/v1/kv/extend", response_model=Handle, **kv)
    async def extend(body: p.ExtendRequest, request: Request) -> Handle:
        tenant = _tenant(request)
        state.check_owned(tenant, [body.handle])
        agent = state.agent(tenant, _agent_of(request, body.agent))
        handle = await state.run(engine.extend, body.handle, body.context, agent=agent)
        state.record(tenant, [handle])
        return handle

    @app.post("/v1/kv/fork", response_model=p.ForkResponse, **kv)
    async def fork(body: p.ForkRequest, request: Request) -> p.ForkResponse:
        tenant = _tenant(request)
        state.check_owned(tenant, [body.handle])
        handles = await state.run(engine.fork, body.handle, body.k)
        state.record(tenant, handles)
        return p.ForkResponse(handles=handles)

    @app.post("/v1/kv/transfer", response_model=Handle, **kv)
    async def transfer(body: p.TransferRequest, request: Request) -> Handle:
        """Move a handle's KV to another worker of a multi-device server (transfer or recompute,
        whichever the cost model predicts cheaper); a no-op to the device it is on."""
        tenant = _tenant(request)
        state.check_owned(tenant, [body.handle])
        handle = await state.run(engine.transfer, body.handle, body.device)
        state.record(tenant, [handle])
        return handle

    def segments(parts: Sequence[p.SegmentIn]) -> list[Segment]:
        return [
            Segment(
                handle=part.handle if isinstance(part.handle, Handle) else engine.describe(part.handle),
                start=part.start, end=part.end, slot=part.slot,
            )
            for part in parts
        ]

    @app.post("/v1/kv/compose", response_model=Composition, **kv)
    async def compose(body: p.ComposeRequest, request: Request) -> Composition:
        """Assemble prefix + segments + suffix from existing K/V (exact, re-aligned, corrected or
        recomputed per segment, as the report says)."""
        tenant = _tenant(request)
        if body.prefix_handle is not None and body.prefix is not None:
            raise InvalidRequest("give prefix_handle or prefix, not both")
        state.check_owned(tenant, [*(s.handle for s in body.segments), *([body.prefix_handle] if body.prefix_handle else [])])
        agent = state.agent(tenant, _agent_of(request, body.agent))

        def run() -> Composition:
            prefix: Any = body.prefix
            if body.prefix_handle is not None:
                ref = body.prefix_handle
                prefix = ref if isinstance(ref, Handle) else engine.describe(ref)
            return engine.compose(
                prefix, segments(body.segments), body.suffix, agent=agent, mode=body.mode, correction=body.correction
            )

        result = await state.run(run)
        state.record(tenant, [result.handle])
        return result

    @app.post("/v1/kv/merge", response_model=Composition, **kv)
    async def merge(body: p.MergeRequest, request: Request) -> Composition:
        """Restricted merge: prefix-compatible handles, or non-overlapping segments; never blending."""
        tenant = _tenant(request)
        state.check_owned(tenant, [part.handle for part in body.parts])
        agent = state.agent(tenant, _agent_of(request, body.agent))

        def run() -> Composition:
            whole = all(part.start == 0 and part.end is None and part.slot is None for part in body.parts)
            segs = segments(body.parts)
            parts: list[Any] = [s.handle for s in segs] if whole else segs
            return engine.merge(parts, agent=agent, mode=body.mode, correction=body.correction)

        result = await state.run(run)
        state.record(tenant, [result.handle])
        return result

    @app.post("/v1/kv/fidelity", response_model=Fidelity, **kv)
    async def fidelity(body: p.FidelityRequest, request: Request) -> Fidelity:
        """Compare a handle's continuation with dense prefill of its tokens."""
        tenant = _tenant(request)
        state.check_owned(tenant, [body.handle, *([body.reference] if body.reference else [])])
        state.sampling({"max_tokens": body.max_tokens})  # the server's max_tokens cap holds here too
        return await state.run(engine.fidelity, body.handle, body.max_tokens, reference=body.reference)

    async def generation(
        endpoint: str, tenant: str, start: Callable[[], TokenStream], stream: bool
    ) -> Result | Response:
        if not stream:
            result = await state.run(lambda: start().until_done())
            state.record(tenant, [result.handle])
            state.metrics.observe(endpoint, result)
            return result
        token_stream = await state.run(start)
        first = await state.run(_prime, token_stream)

        def finished(result: Result) -> None:
            state.record(tenant, [result.handle])
            state.metrics.observe(endpoint, result)

        return EventStreamResponse(_native_events(state, token_stream, first, finished))

    @app.post("/v1/kv/resume", response_model=Result, **{**kv, "responses": _STREAM_RESPONSES})
    async def resume(body: p.ResumeRequest, request: Request) -> Any:
        tenant = _tenant(request)
        state.check_owned(tenant, [body.handle])
        agent = state.agent(tenant, _agent_of(request, body.agent))
        params = state.sampling(body.sampling_fields())
        return await generation(
            "/v1/kv/resume", tenant,
            lambda: engine.resume_stream(body.handle, body.suffix, params, agent=agent),
            body.stream,
        )

    @app.post("/v1/kv/complete", response_model=Result, **{**kv, "responses": _STREAM_RESPONSES})
    async def complete(body: p.CompleteRequest, request: Request) -> Any:
        tenant = _tenant(request)
        agent = state.agent(tenant, _agent_of(request, body.agent))
        params = state.sampling(body.sampling_fields())
        return await generation(
            "/v1/kv/complete", tenant, lambda: engine.complete_stream(body.prompt, params, agent=agent), body.stream,
        )

    @app.post("/v1/kv/generate", response_model=Result, **{**kv, "responses": _STREAM_RESPONSES})
    async def generate(body: p.GenerateRequest, request: Request) -> Any:
        tenant = _tenant(request)
        if body.handle is not None:
            state.check_owned(tenant, [body.handle])
        agent = state.agent(tenant, _agent_of(request, body.agent))
        params = state.sampling(body.sampling_fields())
        return await generation(
            "/v1/kv/generate", tenant,
            lambda: _template_errors(lambda: engine.generate_stream(
                body.messages, handle=body.handle, tools=body.tools, sampling=params, agent=agent
            )),
            body.stream,
        )

    @app.post("/v1/kv/release", response_model=p.ReleaseResponse, **kv)
    async def release(body: p.ReleaseRequest, request: Request) -> p.ReleaseResponse:
        await state.run(state.release, _tenant(request), body.handles)
        return p.ReleaseResponse(released=len(body.handles))

    @app.post("/v1/kv/release_all", response_model=p.ReleaseResponse, **kv)
    async def release_all(request: Request) -> p.ReleaseResponse:
        """Release every live handle of the caller's tenant, including the handles the OpenAI endpoints
        retain for its agents."""
        tenant = _tenant(request)

        def run() -> int:
            for slot in state.slots.tenant_slots(tenant):
                with slot.lock:
                    slot.handle_id = None
            ids = state.owners.live(tenant)
            state.release_quietly(ids)
            return len(ids)

        return p.ReleaseResponse(released=await state.run(run))

    @app.get("/v1/kv/stats", response_model=Stats, **kv)
    async def stats(request: Request) -> Stats:
        return await state.run(state.stats, _tenant(request))

    @app.post("/v1/kv/tokenize", response_model=p.TokenIds, **kv)
    async def tokenize(body: p.TokenizeRequest) -> p.TokenIds:
        return p.TokenIds(token_ids=await state.run(engine.tokenize, body.text))

    @app.post("/v1/kv/detokenize", response_model=p.Text, **kv)
    async def detokenize(body: p.DetokenizeRequest) -> p.Text:
        return p.Text(text=await state.run(engine.detokenize, body.token_ids))

    @app.post("/v1/kv/chat_tokens", response_model=p.TokenIds, **kv)
    async def chat_tokens(body: p.ChatTokensRequest) -> p.TokenIds:
        ids = await state.run(lambda: _template_errors(lambda: engine.chat_tokens(
            body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt
        )))
        return p.TokenIds(token_ids=ids)

    if hasattr(engine, "register_agent"):

        @app.post("/v1/kv/agents", response_model=p.AgentInfoOut, **kv)
        async def register_agent(body: p.RegisterAgentRequest, request: Request) -> p.AgentInfoOut:
            """Declare an agent's fixed prompt (system prompt, tools...) for workflow-aware caching."""
            tenant = _tenant(request)
            name = state.agent(tenant, body.name)
            info = await state.run(lambda: _template_errors(
                lambda: engine.register_agent(name, body.fixed_prompt, prefill=body.prefill)
            ))
            return p.AgentInfoOut(name=body.name, fixed_tokens=info.fixed_tokens)

    if hasattr(engine, "hints"):

        @app.post("/v1/kv/hints", response_model=p.HintsResponse, **kv)
        async def hints(body: p.HintsRequest, request: Request) -> p.HintsResponse:
            """Steps-to-execution of the caller's agents (0 = running now); prefetches those due soon."""
            ste = await state.run(state.hints, _tenant(request), body.steps, body.running)
            return p.HintsResponse(steps=ste)


async def _pull(state: ServerState, stream: TokenStream) -> Any:
    return await state.run(next, stream, _END)


async def _native_events(
    state: ServerState, stream: TokenStream, first: StreamChunk | None, finished: Callable[[Result], None]
) -> AsyncIterator[str]:
    """``event: chunk`` per StreamChunk, then ``event: result`` (or ``event: error``)."""
    try:
        chunk: Any = first
        while chunk is not None and chunk is not _END:
            yield _sse(chunk.model_dump_json(), "chunk")
            chunk = await _pull(state, stream)
        assert stream.result is not None
        finished(stream.result)
        yield _sse(stream.result.model_dump_json(), "result")
    except KvbatonError as exc:
        yield _sse(json.dumps({"error": {"code": exc.code, "message": exc.message}}), "error")
    except Exception as exc:  # the response has started: report in-band
        log.exception("stream failed")
        yield _sse(json.dumps({"error": {"code": "internal_error", "message": type(exc).__name__}}), "error")
    finally:
        with anyio.CancelScope(shield=True):
            await state.run(stream.close)


# -- OpenAI compatible -------------------------------------------------------------------------


def _text_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text") and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"only text content is supported, got a {kind!r} part")
        return "".join(parts)
    raise InvalidRequest(f"message content must be text or a list of text parts, got {type(content).__name__}")


_ROLES = {"developer": "system", "function": "tool"}


def _openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise InvalidRequest("each message must be an object with role and content")
        role = m.get("role")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = _ROLES.get(role, role) if isinstance(role, str) else role
        msg["content"] = _text_content(m.get("content"))
        out.append(msg)
    return out


@dataclass
class _ChatPlan:
    tenant: str
    agent: str
    engine_agent: str | None
    key: tuple[str, str]
    reuse: p.HandleRef | None
    keep: bool
    step: str | int | None
    n: int
    params: list[SamplingParams]


def _usage(results: Sequence[Result]) -> dict[str, Any]:
    first = results[0].timings
    prompt = first.tokens_reused + first.tokens_prefilled
    completion = sum(r.timings.tokens_generated for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": first.tokens_reused},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    oa = {"tags": ["openai"], "responses": _STREAM_RESPONSES}

    @app.get("/v1/models", tags=["openai"])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}", tags=["openai"], responses=_ERROR_RESPONSES)
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != state.model:
            return error_response("model_not_found", f"this server runs {state.model!r}, not {model_id!r}")
        return _model_card(state)

    def plan(request: Request, ext: p.KvbatonExtension | None, n: int, fields: dict[str, Any], seed: int | None) -> _ChatPlan:
        tenant = _tenant(request)
        ext = ext or p.KvbatonExtension()
        agent = ext.agent if ext.agent is not None else request.headers.get("x-kvbaton-agent", "")
        engine_agent = state.agent(tenant, agent)
        if n > state.max_n:
            raise InvalidRequest(f"n {n} exceeds the server's limit of {state.max_n}")
        if ext.handle is not None:
            state.check_owned(tenant, [ext.handle])
        fields = {k: v for k, v in fields.items() if v is not None}
        fields.setdefault("max_tokens", state.default_max_tokens)
        params = []
        for i in range(n):
            choice_seed = None if seed is None else (seed + i) % 2**63
            params.append(state.sampling({**fields, "seed": choice_seed}))
        return _ChatPlan(tenant, agent, engine_agent, (tenant, agent), ext.handle, ext.keep, ext.step, n, params)

    def start_chat(plan: _ChatPlan, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[list[TokenStream], list[StreamChunk | None]]:
        """Open and prime ``n`` streams reusing the caller's handle or the agent's latest one."""

        def open_stream(handle: p.HandleRef | None, params: SamplingParams) -> TokenStream:
            return _template_errors(functools.partial(
                state.engine.generate_stream, messages, handle=handle, tools=tools, sampling=params,
                agent=plan.engine_agent,
            ))

        while True:
            slot = state.slots.slot(plan.key)
            streams: list[TokenStream] = []
            try:
                with slot.lock:
                    base: p.HandleRef | None = plan.reuse if plan.reuse is not None else slot.handle_id
                    for params in plan.params:
                        try:
                            streams.append(open_stream(base, params))
                        except (HandleNotFound, HandleReleased):
                            if plan.reuse is not None or base is None:
                                raise
                            slot.handle_id = base = None  # the retained handle was released meanwhile
                            streams.append(open_stream(None, params))
                return streams, [_prime(s) for s in streams]
            except PoolExhausted:
                for s in streams:
                    s.close()
                victim = state.slots.oldest_idle(exclude=plan.key)
                if victim is None:
                    raise
                _, vslot = victim
                with vslot.lock:
                    old, vslot.handle_id = vslot.handle_id, None
                if old is not None:
                    state.release_quietly([old])
            except BaseException:
                for s in streams:
                    s.close()
                raise

    def finish_chat(plan: _ChatPlan, results: Sequence[Result]) -> list[str | None]:
        """Record result handles; retain choice 0 in the agent's slot (unless ``keep``), release the rest."""
        handles = [r.handle.id for r in results]
        state.owners.add(plan.tenant, handles)
        if plan.keep:
            return list(handles)
        slot = state.slots.slot(plan.key)
        with slot.lock:
            old, slot.handle_id = slot.handle_id, handles[0]
        drop = [h for h in handles[1:]] + ([old] if old is not None and old != handles[0] else [])
        state.release_quietly(drop)
        for key, evicted in state.slots.overflow():
            if evicted.handle_id is not None:
                state.release_quietly([evicted.handle_id])
        return [handles[0]] + [None] * (len(handles) - 1)

    def ext_body(plan: _ChatPlan, kept: list[str | None], results: Sequence[Result]) -> dict[str, Any]:
        return {
            "handle": kept[0],
            "handles": kept,
            "agent": plan.agent or None,
            "step": plan.step,
            "timings": [r.timings.model_dump() for r in results],
        }

    @app.post("/v1/chat/completions", **oa)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Any:
        extra = body.model_extra or {}
        fields = {
            "max_tokens": body.max_completion_tokens or body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": extra.get("top_k"),
            "stop": body.stop,
        }
        plan_ = plan(request, body.kvbaton, body.n, fields, body.seed)
        messages = _openai_messages(body.messages)
        created = int(time.time())
        cid = "chatcmpl-" + secrets.token_hex(12)
        endpoint = "/v1/chat/completions"

        if not body.stream:
            def run_all() -> tuple[list[Result], list[str | None]]:
                streams, _ = start_chat(plan_, messages, body.tools)
                try:
                    results = [s.until_done() for s in streams]
                finally:
                    for s in streams:
                        s.close()
                return results, finish_chat(plan_, results)

            results, kept = await state.run(run_all)
            for r in results:
                state.metrics.observe(endpoint, r)
            payload = {
                "id": cid, "object": "chat.completion", "created": created, "model": state.model,
                "system_fingerprint": None,
                "choices": [
                    {"index": i, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                     "finish_reason": r.finish_reason}
                    for i, r in enumerate(results)
                ],
                "usage": _usage(results),
                "kvbaton": ext_body(plan_, kept, results),
            }
            headers = {"X-Kvbaton-Handle": kept[0]} if kept[0] else None
            return JSONResponse(payload, headers=headers)

        streams, firsts = await state.run(start_chat, plan_, messages, body.tools)
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
            return _sse(json.dumps({
                "id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model,
                "system_fingerprint": None, "choices": choices, **more,
            }))

        async def events() -> AsyncIterator[str]:
            try:
                results: list[Result] = []
                for i, (stream, first) in enumerate(zip(streams, firsts)):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                    item: Any = first
                    while item is not None and item is not _END:
                        if item.text:
                            yield chunk([{"index": i, "delta": {"content": item.text}, "logprobs": None,
                                          "finish_reason": None}])
                        item = await _pull(state, stream)
                    assert stream.result is not None
                    results.append(stream.result)
                    state.metrics.observe(endpoint, stream.result)
                    if i < len(streams) - 1:
                        yield chunk([{"index": i, "delta": {}, "logprobs": None,
                                      "finish_reason": stream.result.finish_reason}])
                kept = await state.run(finish_chat, plan_, results)
                ext = ext_body(plan_, kept, results)
                yield chunk([{"index": len(streams) - 1, "delta": {}, "logprobs": None,
                              "finish_reason": results[-1].finish_reason}], kvbaton=ext)
                if include_usage:
                    yield chunk([], usage=_usage(results), kvbaton=ext)
                yield _sse("[DONE]")
            except KvbatonError as exc:
                yield _sse(json.dumps({"error": {"code": exc.code, "message": exc.message}}))
            except Exception as exc:
                log.exception("chat stream failed")
                yield _sse(json.dumps({"error": {"code": "internal_error", "message": type(exc).__name__}}))
            finally:
                with anyio.CancelScope(shield=True):
                    for s in streams:
                        await state.run(s.close)

        return EventStreamResponse(events())

    @app.post("/v1/completions", **oa)
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidRequest("only one prompt per request is supported")
            prompt = prompt[0]
        extra = body.model_extra or {}
        fields = {"max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                  "top_k": extra.get("top_k"), "stop": body.stop}
        plan_ = plan(request, body.kvbaton, body.n, fields, body.seed)
        if plan_.reuse is not None:
            raise InvalidRequest("/v1/completions does not take a handle; use /v1/chat/completions or /v1/kv/resume")
        created = int(time.time())
        cid = "cmpl-" + secrets.token_hex(12)
        endpoint = "/v1/completions"

        def finish(results: Sequence[Result]) -> list[str | None]:
            handles = [r.handle.id for r in results]
            state.owners.add(plan_.tenant, handles)
            if plan_.keep:
                return list(handles)
            state.release_quietly(handles)
            return [None] * len(handles)

        def ext_of(kept: list[str | None], results: Sequence[Result]) -> dict[str, Any]:
            return {"handle": kept[0], "handles": kept, "agent": plan_.agent or None, "step": plan_.step,
                    "timings": [r.timings.model_dump() for r in results]}

        if not body.stream:
            def run_all() -> tuple[list[Result], list[str | None]]:
                results = [state.engine.complete(prompt, params, agent=plan_.engine_agent) for params in plan_.params]
                return results, finish(results)

            results, kept = await state.run(run_all)
            for r in results:
                state.metrics.observe(endpoint, r)
            payload = {
                "id": cid, "object": "text_completion", "created": created, "model": state.model,
                "choices": [{"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
                            for i, r in enumerate(results)],
                "usage": _usage(results),
                "kvbaton": ext_of(kept, results),
            }
            return JSONResponse(payload, headers={"X-Kvbaton-Handle": kept[0]} if kept[0] else None)

        def open_streams() -> tuple[list[TokenStream], list[StreamChunk | None]]:
            streams: list[TokenStream] = []
            try:
                for params in plan_.params:
                    streams.append(state.engine.complete_stream(prompt, params, agent=plan_.engine_agent))
                return streams, [_prime(s) for s in streams]
            except BaseException:
                for s in streams:
                    s.close()
                raise

        streams, firsts = await state.run(open_streams)
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
            return _sse(json.dumps({"id": cid, "object": "text_completion", "created": created,
                                    "model": state.model, "choices": choices, **more}))

        async def events() -> AsyncIterator[str]:
            try:
                results: list[Result] = []
                for i, (stream, first) in enumerate(zip(streams, firsts)):
                    item: Any = first
                    while item is not None and item is not _END:
                        if item.text:
                            yield chunk([{"index": i, "text": item.text, "logprobs": None, "finish_reason": None}])
                        item = await _pull(state, stream)
                    assert stream.result is not None
                    results.append(stream.result)
                    state.metrics.observe(endpoint, stream.result)
                    if i < len(streams) - 1:
                        yield chunk([{"index": i, "text": "", "logprobs": None,
                                      "finish_reason": stream.result.finish_reason}])
                kept = await state.run(finish, results)
                ext = ext_of(kept, results)
                yield chunk([{"index": len(streams) - 1, "text": "", "logprobs": None,
                              "finish_reason": results[-1].finish_reason}], kvbaton=ext)
                if include_usage:
                    yield chunk([], usage=_usage(results), kvbaton=ext)
                yield _sse("[DONE]")
            except KvbatonError as exc:
                yield _sse(json.dumps({"error": {"code": exc.code, "message": exc.message}}))
            except Exception as exc:
                log.exception("completion stream failed")
                yield _sse(json.dumps({"error": {"code": "internal_error", "message": type(exc).__name__}}))
            finally:
                with anyio.CancelScope(shield=True):
                    for s in streams:
                        await state.run(s.close)

        return EventStreamResponse(events())


def _model_card(state: ServerState) -> dict[str, Any]:
    card: dict[str, Any] = {"id": state.model, "object": "model", "created": 0, "owned_by": "kvbaton"}
    if state.max_context:
        card["max_model_len"] = state.max_context
    return card


# -- running -------------------------------------------------------------------------------------


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    model: str | None = None,
    token: str | Sequence[str] | None = None,
    log_level: str = "info",
    engine_options: dict[str, Any] | None = None,
    cluster_options: dict[str, Any] | None = None,
    **app_options: Any,
) -> None:
    """Build the engine and run the server until interrupted. A non-loopback ``host`` needs a token.

    With ``cluster_options`` (``devices``, ``world_size``...: see :class:`.cluster.Cluster`), one
    worker process per device serves behind this server instead of an in-process engine."""
    import uvicorn

    from .engine import Engine

    tokens = [token] if isinstance(token, str) else list(token or [])
    check_bind(host, tokens)
    if cluster_options:
        from .cluster import Cluster

        options = {k: v for k, v in (engine_options or {}).items() if k != "device"}
        engine: Any = Cluster(model=model, engine_options=options, **cluster_options)
    else:
        engine = Engine(model, **(engine_options or {}))
    try:
        app = create_app(engine, token=tokens or None, **app_options)
        log.info("kvbaton %s serving %s on http://%s:%d (%s)", kvbaton.__version__, engine.loaded.name, host, port,
                 f"{len(tokens)} token(s)" if tokens else "no auth, loopback only")
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, access_log=False)
    finally:
        if cluster_options:
            engine.close()
