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
import inspect
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import anyio
import kvbaton
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from kvbaton import serverconf as conf
from kvbaton.embedded import EmbeddedClient
from kvbaton.errors import InvalidRequest
from kvbaton.types import Reuse

from ..config import EngineConfig
from ..hosting import HEALTHY, HostedEngine
from . import protocol as p
from .accesslog import AccessLogMiddleware, Throughput
from .concurrency import Concurrency, ConcurrencyMiddleware
from .dashboard import PUBLIC_PATHS as DASHBOARD_PATHS
from .dashboard import add_dashboard_routes
from .errors import RETRY_AFTER_S, install_error_handlers
from .eventviews import PUMP_INTERVAL_S
from .listener import DEFAULT_CLIENT_TIMEOUT_S, bind, bound_port, check_client_timeout, http_server
from .metrics import CONTENT_TYPE
from .middleware import AuthMiddleware, BodyLimitMiddleware, ErrorMiddleware, MetricsMiddleware
from .native import add_native_routes
from .openai import add_openai_routes
from .state import LIMITS, ServerState, check_limits
from .tenancy import request_tenant, tenant_map

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 4096  # when the model does not say its context
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
    admin_token: str | Sequence[str] | None = None,
    max_requests: int | None = None,
    max_requests_per_tenant: int | None = None,
    max_streams: int | None = conf.DEFAULT_MAX_STREAMS,
    max_streams_per_tenant: int | None = conf.DEFAULT_MAX_STREAMS_PER_TENANT,
    max_registered_agents: int | None = conf.DEFAULT_MAX_REGISTERED_AGENTS,
    max_fidelity_tokens: int | None = conf.DEFAULT_MAX_FIDELITY_TOKENS,
    allowed_origins: Sequence[str] | None = None,
) -> FastAPI:
    """The FastAPI app around ``target``: a :class:`kvbaton.backend.Engine` (or any
    :class:`..hosting.HostedEngine`: ``Cluster``, ``SglangEngine``) or an ``EmbeddedClient``.

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
    ``Engine(reuse=...)``). With tokens each tenant's requests reuse only their own tenant's spans
    across prefixes (the engine's tenant partition) unless ``shared_spans``; an engine that cannot
    partition its spans (``Cluster``) then serves every request ``"exact"``. With several tokens each
    tenant's requests also reuse only prefix-cache blocks its own requests computed (an engine that
    cannot partition its prefix cache is refused) unless ``shared_prefix_cache``.
    ``served_model_names`` are the model's names in ``/v1/models`` and in answers (default: its own).
    Every request is logged at INFO on ``kvbaton.access``, and the throughput every ``stats_interval``
    seconds (0: never) on ``kvbaton.stats``.
    ``admin_token`` (one or several): the token(s) that read ``/metrics`` whole; a tenant's token reads
    its own metrics only (docs/server.md#metrics). ``max_requests`` (default: ``threads``) requests
    run at once, at most ``max_requests_per_tenant`` of one tenant (default: half the threads with
    several tenants), the others wait their turn, tenant by tenant; at most ``max_streams`` streams
    are open at once, ``max_streams_per_tenant`` of one tenant (:mod:`.concurrency`; 0/None: no limit).
    A tenant keeps at most ``max_registered_agents`` registered agents (its least recently registered
    one is dropped beyond); ``POST /v1/kv/fidelity`` checks handles of at most ``max_fidelity_tokens``.
    ``allowed_origins`` (e.g. ``["https://app.example"]``,
    ``["*"]``; default none) lets browser pages of those origins call the server (CORS: Starlette's
    ``CORSMiddleware``, preflights answered without a token; the token is still required on every
    request itself); without it no CORS header is sent.
    """
    engine = engine_of(target)
    admins = [admin_token] if isinstance(admin_token, str) else list(admin_token or [])
    conf.check_tokens(admins, "admin tokens")
    persistence = engine.persistence  # an Engine(persist=True): tenant ids and handles survive restarts
    tenants = tenant_map(token, persistence.salt if persistence is not None else None)
    check_limits(threads=threads, max_requests=max_requests, max_requests_per_tenant=max_requests_per_tenant,
                 max_streams=max_streams, max_streams_per_tenant=max_streams_per_tenant)
    state = ServerState(
        engine, tenants=tenants, max_tokens=max_tokens, default_max_tokens=default_max_tokens, max_n=max_n,
        max_agents=max_agents, threads=threads, fallback_max_tokens=DEFAULT_MAX_TOKENS,
        max_handles_per_tenant=max_handles_per_tenant, max_kv_bytes_per_tenant=max_kv_bytes_per_tenant,
        max_handle_tokens_per_tenant=max_handle_tokens_per_tenant,
        handle_ttl=handle_ttl, reuse=reuse, shared_spans=shared_spans,
        shared_prefix_cache=shared_prefix_cache, served_model_names=served_model_names,
        concurrency=Concurrency.of_server(threads=threads, tenants=len(set(tenants.values())),
                                          max_requests=max_requests, per_tenant=max_requests_per_tenant,
                                          max_streams=max_streams, max_streams_per_tenant=max_streams_per_tenant),
        max_registered_agents=max_registered_agents, max_fidelity_tokens=max_fidelity_tokens,
    )
    if set(admins) & set(tenants):
        raise InvalidRequest("an admin token cannot also be a tenant's token")
    throughput = Throughput()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            if state.handle_ttl is not None:
                tasks.start_soon(_sweep_forever, state)
            if stats_interval > 0:
                tasks.start_soon(_log_throughput_forever, throughput, stats_interval)
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
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(AuthMiddleware, tenants=tenants, public=DASHBOARD_PATHS, admin=admins)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["*"], expose_headers=list(EXPOSED_HEADERS), max_age=600)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    app.add_middleware(AccessLogMiddleware, requests=throughput.finished)
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


def serve(
    host: str = conf.DEFAULT_HOST,
    port: int = conf.DEFAULT_PORT,
    *,
    config: EngineConfig | None = None,
    token: str | Sequence[str] | None = None,
    log_level: str = "info",
    cluster_options: dict[str, Any] | None = None,
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT_S,
    **app_options: Any,
) -> None:
    """Build the engine of ``config`` and run the server until interrupted. A non-loopback ``host``
    needs a token.

    Everything that can be checked without the engine is checked first, then the socket is bound
    (a taken port fails here, at once), and only then does the model load: a bad option or address
    never costs a model load (``InvalidRequest``). ``client_timeout``: how long a client may stall
    a connection (:mod:`.listener`).

    With ``cluster_options`` (``devices``, ``world_size``...: see :class:`kvbaton.backend.cluster.Cluster`), one
    worker process per device runs an engine of ``config`` behind this server instead of an in-process engine."""
    from ..engine import Engine

    config = config or EngineConfig()
    tokens = [token] if isinstance(token, str) else list(token or [])
    check_serve_options(host, tokens, client_timeout=client_timeout, **app_options)
    sock = bind(host, port)
    port = bound_port(sock)
    model = config.model or "the default model"
    try:
        if cluster_options:
            from ..cluster.coordinator import Cluster

            workers = len(cluster_options.get("devices") or ())
            with _progress(f"starting {workers} worker(s) for {model}"):
                engine: HostedEngine = Cluster(config=config, **cluster_options)
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
        app = create_app(engine, token=tokens or None, **app_options)
        log.info("kvbaton %s serving %s on http://%s:%d (%s)", kvbaton.__version__,
                 app.state.kvbaton.model, host, port, f"{len(tokens)} token(s)" if tokens else "no auth, loopback only")
        run_app(app, sock, log_level=log_level, client_timeout=client_timeout)
    finally:
        sock.close()
        engine.close()
        if main:
            signal.signal(signal.SIGTERM, previous)


def check_serve_options(host: str, tokens: Sequence[str], *, client_timeout: float = DEFAULT_CLIENT_TIMEOUT_S,
                        **app_options: Any) -> None:
    """Refuse (``InvalidRequest``) what ``serve`` would otherwise refuse only once the engine is
    loaded: the bind policy, the tokens, an unknown option, and every limit of :func:`create_app`."""
    conf.check_bind(host, tokens)
    check_client_timeout(client_timeout)
    try:
        options = inspect.signature(create_app).bind(None, token=tokens or None, **app_options).arguments
    except TypeError as exc:
        raise InvalidRequest(f"invalid server option: {exc}") from None
    tenant_map(tokens or None)
    admins = options.get("admin_token")
    conf.check_tokens([admins] if isinstance(admins, str) else list(admins or []), "admin tokens")
    if options.get("max_body_bytes", 1) < 1:
        raise InvalidRequest(f"max_body_bytes must be >= 1, got {options['max_body_bytes']}")
    if options.get("stats_interval", 0) < 0:
        raise InvalidRequest(f"the stats interval must be >= 0 seconds, got {options['stats_interval']}")
    check_limits(**{k: v for k, v in options.items() if k in LIMITS})


def run_app(app: FastAPI, sock: socket.socket, *, log_level: str,
            client_timeout: float = DEFAULT_CLIENT_TIMEOUT_S) -> None:
    """Run ``app`` under uvicorn on the bound ``sock`` (:mod:`.listener`, its connections guarded by
    ``client_timeout``) until SIGINT or SIGTERM, its log lines in kvbaton's format. On the
    signal the app starts draining (``ServerState.draining``) before uvicorn waits for connections:
    generations in flight end at their next token (a stream with an in-band 503, its handles
    released) and event streams end, so they finish well within uvicorn's 5 s grace period instead
    of being cancelled, each with a traceback."""
    state: ServerState = app.state.kvbaton

    def drain() -> None:
        state.draining = True

    server = http_server(app, log_level=log_level, client_timeout=client_timeout, on_exit=drain,
                         timeout_graceful_shutdown=5, access_log=False, log_config=uvicorn_log_config(log_level))
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
