"""The app: ``create_app(engine)`` wires state, routes, error handlers and middlewares; ``serve``
(``kvbaton serve``) builds the engine and runs the app under uvicorn.

Invariants: the engine is a :class:`kvbaton.ops.EngineOps` (anything else is a ``TypeError`` at
``create_app``, not an error on some later request); middlewares run outermost first as metrics,
auth, body limit, so metrics see every answer and auth runs before a body is read; ``/health`` is
200 only while the engine can serve (else 503 "unhealthy" with the reason); with a handle TTL, a
sweeper task lives as long as the app and releases idle handles.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import anyio
import kvbaton
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from kvbaton import serverconf as conf
from kvbaton.capabilities import Capabilities
from kvbaton.errors import InvalidRequest
from kvbaton.ops import EngineOps
from kvbaton.types import Reuse

from .. import protocol as p
from .accesslog import AccessLogMiddleware, Throughput
from .dashboard import PUBLIC_PATHS as DASHBOARD_PATHS
from .dashboard import add_dashboard_routes
from .errors import ERROR_RESPONSES, RETRY_AFTER_S, install_error_handlers
from .metrics import CONTENT_TYPE
from .middleware import AuthMiddleware, BodyLimitMiddleware, MetricsMiddleware
from .native import add_native_routes
from .openai import add_openai_routes
from .state import ServerState
from .tenancy import tenant_map

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 4096  # when the model does not say its context


def engine_of(target: Any) -> EngineOps:
    """The engine behind ``target``: an engine itself, or an ``EmbeddedClient``'s ``.engine``."""
    engine = getattr(target, "engine", target)
    if not isinstance(engine, EngineOps):
        raise TypeError(
            f"create_app needs a kvbaton engine (Engine, Cluster, SglangEngine: kvbaton.ops.EngineOps) "
            f"or an EmbeddedClient, got {type(target).__name__}"
        )
    return engine


def create_app(
    target: Any,
    *,
    token: str | Sequence[str] | Mapping[str, str] | None = None,
    max_body_bytes: int = conf.DEFAULT_MAX_BODY_BYTES,
    max_tokens: int | None = None,
    default_max_tokens: int = conf.DEFAULT_MAX_TOKENS,
    max_n: int = conf.DEFAULT_MAX_N,
    max_agents: int = conf.DEFAULT_MAX_AGENTS,
    threads: int = conf.DEFAULT_THREADS,
    max_handles_per_tenant: int | None = conf.DEFAULT_MAX_HANDLES_PER_TENANT,
    max_kv_bytes_per_tenant: int | str | None = None,
    max_handle_tokens_per_tenant: int | None = conf.DEFAULT_MAX_HANDLE_TOKENS_PER_TENANT,
    handle_ttl: float | None = None,
    reuse: Reuse | None = None,
    shared_spans: bool = False,
    shared_prefix_cache: bool = False,
    served_model_names: Sequence[str] | None = None,
    stats_interval: float = conf.DEFAULT_STATS_INTERVAL_S,
) -> FastAPI:
    """The FastAPI app around ``target``: a :class:`kvbaton.backend.Engine` (or any
    :class:`kvbaton.ops.EngineOps`: ``Cluster``, ``SglangEngine``) or an ``EmbeddedClient``.

    ``token``: one bearer token, several (each its own tenant), or a ``{token: tenant_name}`` map;
    ``None`` (or empty) serves without authentication, everything in one tenant.
    ``max_tokens`` caps ``max_tokens`` of every request (default: the model's context);
    ``default_max_tokens`` applies to requests that give none (every route).
    ``max_handles_per_tenant`` (0/None: no limit), ``max_kv_bytes_per_tenant`` (bytes, ``"2GiB"``
    or ``"N blocks"``; None: no limit) and ``max_handle_tokens_per_tenant`` (tokens of live handles,
    forks counted in full, bounding their token lists' host memory; 0/None: no limit) are each
    tenant's quotas (429 ``quota_exceeded`` beyond);
    ``handle_ttl`` (seconds; None: off) releases handles no operation named for that long.
    ``reuse`` is the reuse policy of requests that name none (None: the engine's own default,
    ``Engine(reuse=...)``, else ``"exact"``). With several tokens each tenant's requests reuse only
    their own tenant's spans across prefixes (the engine's ``span_scope``) unless ``shared_spans``;
    an engine without ``span_scope`` (``Cluster``) then serves every request ``"exact"``. With several
    tokens each tenant's requests also reuse only prefix-cache blocks its own requests computed (the
    engine's ``isolate_prefix_cache``; an engine without it is refused) unless ``shared_prefix_cache``.
    ``served_model_names`` are the model's names in ``/v1/models`` and in answers (default: its own).
    Every request is logged at INFO on ``kvbaton.access``, and the throughput every ``stats_interval``
    seconds (0: never) on ``kvbaton.stats``.
    """
    engine = engine_of(target)
    persistence = getattr(engine, "persistence", None)  # an Engine(persist=True): ids and handles survive restarts
    tenants = tenant_map(token, persistence.salt if persistence is not None else None)
    state = ServerState(
        engine, tenants=tenants, max_tokens=max_tokens, default_max_tokens=default_max_tokens, max_n=max_n,
        max_agents=max_agents, threads=threads, fallback_max_tokens=DEFAULT_MAX_TOKENS,
        max_handles_per_tenant=max_handles_per_tenant, max_kv_bytes_per_tenant=max_kv_bytes_per_tenant,
        max_handle_tokens_per_tenant=max_handle_tokens_per_tenant,
        handle_ttl=handle_ttl, reuse=reuse, shared_spans=shared_spans,
        shared_prefix_cache=shared_prefix_cache, served_model_names=served_model_names,
        journal=persistence.journal if persistence is not None else None,
    )
    throughput = Throughput(engine.stats)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            if state.handle_ttl is not None:
                tasks.start_soon(_sweep_forever, state)
            if stats_interval > 0:
                tasks.start_soon(_log_throughput_forever, state, throughput, stats_interval)
            yield
            tasks.cancel_scope.cancel()

    app = FastAPI(
        title="kvbaton",
        version=kvbaton.__version__,
        description="Pass KV-cache handles instead of text between LLM agents.",
        lifespan=lifespan,
    )
    app.state.kvbaton = state
    install_error_handlers(app, state.healthy)
    add_native_routes(app, state)
    add_openai_routes(app, state)
    add_dashboard_routes(app)

    @app.get("/health", response_model=p.Health, response_model_exclude_none=True, tags=["server"],
             responses={503: {"model": p.Health}})
    async def health() -> Any:
        """200 while the engine can serve; 503 ``unhealthy`` with the reason (and the error schema, so
        SDK clients raise ``ServerUnavailable``) when it cannot, e.g. every worker of a cluster is down."""
        ok, reason = state.healthy()
        if ok:
            return p.Health(model=state.model, version=kvbaton.__version__)
        error = p.ErrorDetail(code="server_unavailable", message=f"the engine cannot serve now: {reason}",
                              type="server_error")
        body = p.Health(status="unhealthy", reason=reason, model=state.model, version=kvbaton.__version__, error=error)
        return JSONResponse(body.model_dump(), status_code=503, headers={"Retry-After": RETRY_AFTER_S})

    @app.get("/v1/capabilities", response_model=Capabilities, tags=["server"], responses=ERROR_RESPONSES)
    async def capabilities() -> Capabilities:
        """What the engine behind this server does exactly, corrects, recomputes or cannot do."""
        return engine.capabilities()

    @app.get("/metrics", tags=["server"], response_class=Response)
    async def metrics() -> Response:
        return Response(await state.run(state.metrics.exposition), media_type=CONTENT_TYPE)

    # Outermost first: metrics see every answer (401 and 413 included), auth runs before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(AuthMiddleware, tenants=tenants, public=DASHBOARD_PATHS)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    app.add_middleware(AccessLogMiddleware, requests=throughput.finished)
    return app


async def _log_throughput_forever(state: ServerState, throughput: Throughput, interval: float) -> None:
    """The throughput line every ``interval`` seconds (none while idle); reading stats may block: off the loop."""
    while True:
        await anyio.sleep(interval)
        try:
            await state.run(throughput.log)
        except Exception:  # noqa: BLE001 - the next interval tries again
            log.exception("throughput log failed")


async def _sweep_forever(state: ServerState) -> None:
    """Release idle handles every quarter TTL (at most every 30 s); a failed sweep is logged, not fatal."""
    assert state.handle_ttl is not None
    interval = min(max(state.handle_ttl / 4, 0.05), 30.0)
    while True:
        await anyio.sleep(interval)
        try:
            swept = await state.run(state.sweep)
        except Exception:  # noqa: BLE001 - the next sweep tries again
            log.exception("handle TTL sweep failed")
            continue
        if swept:
            log.info("released %d handle(s) idle for over %g s", len(swept), state.handle_ttl)


def serve(
    host: str = conf.DEFAULT_HOST,
    port: int = conf.DEFAULT_PORT,
    *,
    model: str | None = None,
    token: str | Sequence[str] | None = None,
    log_level: str = "info",
    engine_options: dict[str, Any] | None = None,
    cluster_options: dict[str, Any] | None = None,
    **app_options: Any,
) -> None:
    """Build the engine and run the server until interrupted. A non-loopback ``host`` needs a token.

    With ``cluster_options`` (``devices``, ``world_size``...: see :class:`kvbaton.backend.cluster.Cluster`), one
    worker process per device serves behind this server instead of an in-process engine."""
    import uvicorn

    from ..engine import Engine

    tokens = [token] if isinstance(token, str) else list(token or [])
    conf.check_bind(host, tokens)
    if cluster_options:
        from ..cluster import Cluster

        options = {k: v for k, v in (engine_options or {}).items() if k not in ("device", "persist")}
        if (engine_options or {}).get("persist"):
            raise InvalidRequest("persistence (--persist) needs a single-device server: a cluster's handles live "
                                 "in its workers")
        workers = len(cluster_options.get("devices") or ())
        with _progress(f"starting {workers} worker(s) for {model or 'the default model'}"):
            engine: Any = Cluster(model=model, engine_options=options, **cluster_options)
    else:
        with _progress(f"loading {model or 'the default model'}"):
            engine = Engine(model, **(engine_options or {}))
    # uvicorn re-raises SIGTERM after its graceful shutdown; with the default action the process would
    # die before the engine is closed (tier directories, worker processes): make it a clean exit.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        app = create_app(engine, token=tokens or None, **app_options)
        log.info("kvbaton %s serving %s on http://%s:%d (%s)", kvbaton.__version__, engine.loaded.name, host, port,
                 f"{len(tokens)} token(s)" if tokens else "no auth, loopback only")
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, access_log=False)
    finally:
        engine.close()
        if main:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _progress(what: str, every_s: float = 10.0) -> Iterator[None]:
    """Log ``what`` now, every ``every_s`` seconds while it lasts (a model load takes up to minutes),
    and when it is done."""
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            log.info("%s... (%.0f s)", what, time.monotonic() - start)

    log.info("%s...", what)
    ticker = threading.Thread(target=beat, name="kvbaton-load-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    log.info("%s: done in %.1f s", what, time.monotonic() - start)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)
