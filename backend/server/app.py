"""The app: ``create_app(engine)`` wires state, routes, error handlers and middlewares; ``serve``
(``kvbaton serve``) builds the engine (or cluster) of an :class:`..config.EngineConfig` and runs the
app under uvicorn.

Invariants: the engine is a :class:`..hosting.HostedEngine` (anything else is a ``TypeError`` at
``create_app``, not an error on some later request); middlewares run outermost first as metrics,
auth, body limit, concurrency, so metrics see every answer, auth runs before a body is read and a
request holds a slot (:mod:`.concurrency`) only once its body is in; ``/health`` is
200 only while the engine can serve (else 503 "unhealthy" with the reason); with a handle TTL, a
sweeper task lives as long as the app and releases idle handles. ``/health`` is 503 "degraded" (with the
reason) while a persistent server's handle journal cannot be written.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
import kvbaton
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from kvbaton import serverconf as conf
from kvbaton.embedded import EmbeddedClient
from kvbaton.errors import InvalidRequest

from ..config import EngineConfig
from ..hosting import HEALTHY, HostedEngine
from . import protocol as p
from .accesslog import AccessLogMiddleware, Throughput
from .args import ServerArgs
from .concurrency import ConcurrencyMiddleware
from .dashboard import PUBLIC_PATHS as DASHBOARD_PATHS
from .dashboard import add_dashboard_routes
from .delivery import DeliveryMiddleware
from .errors import RETRY_AFTER_S, install_error_handlers
from .eventviews import PUMP_INTERVAL_S
from .listener import bind, bound_port, http_server
from .metrics import CONTENT_TYPE
from .middleware import AuthMiddleware, BodyLimitMiddleware, ErrorMiddleware, MetricsMiddleware
from .native import add_native_routes
from .openai_routes import add_openai_routes
from .state import ServerState
from .tenancy import request_tenant, tenant_map

log = logging.getLogger(__name__)

# Response headers a browser's script may read across origins (with --allowed-origins).
EXPOSED_HEADERS = ("X-Kvbaton-Handle", "X-Kvbaton-Approximate", "Retry-After", "x-should-retry")


def engine_of(target: Any) -> HostedEngine:
    """The engine behind ``target``: an engine itself, or an ``EmbeddedClient``'s ``.engine``."""
    engine = target.engine if isinstance(target, EmbeddedClient) else target
    if not isinstance(engine, HostedEngine):
        raise TypeError(
            "create_app needs a kvbaton engine (Engine, Cluster, SglangEngine: a kvbaton.ops.EngineOps with the "
            f"hosted contract of kvbaton.backend.hosting.HostedEngine) or an EmbeddedClient, got {type(target).__name__}"
        )
    return engine


def create_app(target: Any, args: ServerArgs | None = None, **options: Any) -> FastAPI:
    """The FastAPI app around ``target``: a :class:`kvbaton.backend.Engine` (or any
    :class:`..hosting.HostedEngine`: ``Cluster``, ``SglangEngine``) or an ``EmbeddedClient``.

    Its options are one :class:`.args.ServerArgs` (``args``), and/or its fields as keywords
    (``create_app(engine, token=[...], max_tokens=64)``), which override ``args``'s: every limit,
    default and policy of the server is read from it (docs/server.md's table says what each does).
    ``token``: one bearer token, several (each its own tenant), or a ``{token: tenant_name}`` map;
    none serves without authentication, everything in one tenant. A bad option is ``InvalidRequest``
    naming it; an engine that cannot keep several tenants' prefix caches apart is refused unless
    ``shared_prefix_cache``.
    """
    args = ServerArgs.of(args, **options)
    engine = engine_of(target)
    admins = args.admin_tokens()
    persistence = engine.persistence  # an Engine(persist=True): tenant ids and handles survive restarts
    # The secret of tenant ids: a persistent server's own; a cluster's, so that every ingress of it names a
    # token's tenant alike; else this process's.
    salt = persistence.salt if persistence is not None else getattr(engine, "tenant_salt", None)
    tenants = tenant_map(args.token, salt)
    state = ServerState(engine, tenants=tenants, args=args)
    if set(admins) & set(tenants):
        raise InvalidRequest("an admin token cannot also be a tenant's token")
    throughput = Throughput()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            if state.handle_ttl is not None:
                tasks.start_soon(_sweep_forever, state)
            if args.stats_interval > 0:
                tasks.start_soon(_log_throughput_forever, throughput, args.stats_interval)
            tasks.start_soon(_pump_events_forever, state)
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
        SDK clients raise ``ServerUnavailable``) when it cannot, e.g. every worker of a cluster is down;
        503 ``degraded`` while it serves only the requests that make no handle (the handle journal
        cannot be written: the reason names it)."""
        ok, reason = state.healthy()
        journal = state.degraded() if ok else None  # the handle journal cannot be written
        if ok and journal is None and reason == HEALTHY:
            return p.Health(model=state.model, version=kvbaton.__version__)
        if ok and journal is None:  # it serves every request, with less (a cluster worker down)
            return p.Health(status="degraded", reason=reason, model=state.model, version=kvbaton.__version__)
        reason = journal or reason
        message = (f"the server is degraded: {reason}" if journal else f"the engine cannot serve now: {reason}")
        error = p.ErrorDetail(code="server_unavailable", message=message, type="server_error")
        body = p.Health(status="degraded" if journal else "unhealthy", reason=reason, model=state.model,
                        version=kvbaton.__version__, error=error)
        return JSONResponse(body.model_dump(), status_code=503, headers={"Retry-After": RETRY_AFTER_S})

    @app.get("/metrics", tags=["server"], response_class=Response)
    async def metrics(request: Request) -> Response:
        """Prometheus metrics: all of them without tokens or with an admin token; a tenant's token sees
        its own requests, agents and usage only."""
        if request.scope.get("kvbaton.admin") or not state.multi_tenant:
            return Response(await state.run(state.metrics.exposition), media_type=CONTENT_TYPE)
        mine = await state.run(state.metrics.tenant_exposition, request_tenant(request))
        return Response(mine, media_type=CONTENT_TYPE)

    # Outermost first: metrics see every answer (401 and 413 included); a browser's CORS preflight is
    # answered before auth (it carries no token); auth runs before the body is read; a request holds a
    # slot only once its body is in (a slow upload holds none); unexpected errors are answered
    # innermost, so everything outside sees the status the client got.
    app.add_middleware(ErrorMiddleware, healthy=state.healthy)
    app.add_middleware(ConcurrencyMiddleware, concurrency=state.concurrency)
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_body_bytes)
    app.add_middleware(AuthMiddleware, tenants=tenants, public=DASHBOARD_PATHS, admin=admins)
    if args.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(args.allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["*"], expose_headers=list(EXPOSED_HEADERS), max_age=600)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    app.add_middleware(AccessLogMiddleware, requests=throughput.finished)

    async def release_undelivered(ids: list[str]) -> None:
        await state.run(state.release_undelivered, ids)

    app.add_middleware(DeliveryMiddleware, release=release_undelivered)  # outermost: it reads the server's send
    return app


async def _log_throughput_forever(throughput: Throughput, interval: float) -> None:
    """The throughput line every ``interval`` seconds (none while idle), from the counts of the
    requests that ended (on the event loop, where the access log counts them)."""
    while True:
        await anyio.sleep(interval)
        throughput.log()


async def _pump_events_forever(state: ServerState) -> None:
    """Route the engine's new events into the tenants' views (:mod:`.eventviews`) every
    ``PUMP_INTERVAL_S``, so that the engine's bounded ring does not lose them between reads."""
    while True:
        await anyio.sleep(PUMP_INTERVAL_S)
        try:
            await state.run(state.views.pump)
        except Exception:
            log.exception("reading the engine's events failed")


async def _sweep_forever(state: ServerState) -> None:
    """Release idle handles every quarter TTL (at most every 30 s); a failed sweep is logged, not fatal."""
    assert state.handle_ttl is not None
    interval = min(max(state.handle_ttl / 4, 0.05), 30.0)
    while True:
        await anyio.sleep(interval)
        try:
            swept = await state.run(state.sweep)
        except Exception:
            log.exception("handle TTL sweep failed")
            continue
        if swept:
            log.info("released %d handle(s) idle for over %g s", len(swept), state.handle_ttl)


def serve(args: ServerArgs | None = None, *, config: EngineConfig | None = None,
          cluster_options: dict[str, Any] | None = None, **options: Any) -> None:
    """Build the engine of ``config`` and run the server of ``args`` (and/or its fields as keywords)
    until interrupted. A non-loopback ``host`` needs a token.

    Everything that can be checked without the engine is checked first, then the socket is bound
    (a taken port fails here, at once), and only then does the model load: a bad option or address
    never costs a model load (``InvalidRequest``).

    With ``cluster_options`` (``devices``, ``ray_address``...: see :class:`kvbaton.backend.cluster.Cluster`), one
    worker process per device runs an engine of ``config`` behind this server instead of an in-process engine."""
    from ..engine import Engine

    config = config or EngineConfig()
    args = check_serve_options(args, **options)
    sock = bind(args.host, args.port)
    port = bound_port(sock)
    model = config.model or "the default model"
    try:
        if cluster_options:
            from ..cluster.coordinator import Cluster

            if cluster_options.get("attach"):
                with _progress(f"attaching to cluster {cluster_options['attach']!r}"):
                    engine: HostedEngine = Cluster.attach(cluster_options["attach"],
                                                          ray_address=cluster_options.get("ray_address"))
            else:
                workers = len(cluster_options.get("devices") or ())
                with _progress(f"starting {workers} worker(s) for {model}"):
                    engine = Cluster(config=config, **cluster_options)
        else:
            with _progress(f"loading {model}"):
                engine = Engine(config=config)
    except BaseException:
        sock.close()
        raise
    # uvicorn re-raises SIGTERM after its graceful shutdown; with the default action the process would
    # die before the engine is closed (tier directories, worker processes): make it a clean exit.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        app = create_app(engine, args)
        tokens = args.tokens()
        log.info("kvbaton %s serving %s on http://%s:%d (%s)", kvbaton.__version__,
                 app.state.kvbaton.model, args.host, port, f"{len(tokens)} token(s)" if tokens else
                 "no auth, loopback only")
        run_app(app, sock)
    finally:
        sock.close()
        engine.close()
        if main:
            signal.signal(signal.SIGTERM, previous)


def check_serve_options(args: ServerArgs | str | None = None, tokens: Sequence[str] | None = None,
                        **options: Any) -> ServerArgs:
    """The server's options (``args`` and/or keywords), refused (``InvalidRequest``) where ``serve``
    would otherwise refuse them only once the engine is loaded: the bind policy, the tokens, an
    unknown option, every limit. (``check_serve_options(host, tokens, **options)``, the older form,
    is still read.)"""
    if isinstance(args, str):  # the older positional form: host, tokens
        options = {"host": args, "token": list(tokens or []) or None, **options}
        args = None
    parsed = ServerArgs.of(args, **options)
    conf.check_bind(parsed.host, parsed.tokens())
    tenant_map(parsed.token)
    return parsed


def run_app(app: FastAPI, sock: socket.socket, *, log_level: str | None = None,
            client_timeout: float | None = None) -> None:
    """Run ``app`` under uvicorn on the bound ``sock`` (:mod:`.listener`, its connections guarded by
    the app's ``client_timeout``) until SIGINT or SIGTERM, its log lines in kvbaton's format. On the
    signal the app starts draining (``ServerState.draining``) before uvicorn waits for connections:
    generations in flight end at their next token (a stream with an in-band 503, its handles
    released) and event streams end, so they finish within the grace period (``shutdown_timeout``)
    instead of being cancelled; a call that cannot be interrupted (a long materialize) has that
    long to finish. ``log_level`` and ``client_timeout``: the app's own (``ServerArgs``) unless given."""
    state: ServerState = app.state.kvbaton
    args = state.args
    log_level = log_level or args.log_level
    client_timeout = client_timeout or args.client_timeout

    def drain() -> None:
        state.draining = True

    server = http_server(app, log_level=log_level, client_timeout=client_timeout, on_exit=drain,
                         timeout_graceful_shutdown=args.shutdown_timeout, access_log=False, log_config=uvicorn_log_config(log_level))
    server.run(sockets=[sock])


def uvicorn_log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, in kvbaton's one format (``serverconf.LOG_FORMAT``): its loggers keep no
    handler and format of their own and go to the root logger, as kvbaton's do (a root logger
    without a handler gets one in that format)."""
    config: dict[str, Any] = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"kvbaton": {"format": conf.LOG_FORMAT}},
        "loggers": {name: {"handlers": [], "level": level.upper(), "propagate": True}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }
    if not logging.getLogger().handlers:  # (a "root" entry would replace the handlers it has)
        config["handlers"] = {"kvbaton": {"class": "logging.StreamHandler", "formatter": "kvbaton"}}
        config["root"] = {"handlers": ["kvbaton"], "level": level.upper()}
    return config


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
