"""The app: ``create_app(engine)`` wires state, routes, error handlers and middlewares; ``serve``
(``kvbaton serve``) builds the engine and runs the app under uvicorn.

Invariants: the engine is a :class:`kvbaton.ops.EngineOps` (anything else is a ``TypeError`` at
``create_app``, not an error on some later request); middlewares run outermost first as metrics,
auth, body limit, so metrics see every answer and auth runs before a body is read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import kvbaton
from fastapi import FastAPI
from fastapi.responses import Response
from kvbaton import serverconf as conf
from kvbaton.capabilities import Capabilities
from kvbaton.ops import EngineOps

from .. import protocol as p
from .errors import ERROR_RESPONSES, install_error_handlers
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
    default_max_tokens: int = conf.DEFAULT_OPENAI_MAX_TOKENS,
    max_n: int = conf.DEFAULT_MAX_N,
    max_agents: int = conf.DEFAULT_MAX_AGENTS,
    threads: int = conf.DEFAULT_THREADS,
) -> FastAPI:
    """The FastAPI app around ``target``: a :class:`kvbaton.backend.Engine` (or any
    :class:`kvbaton.ops.EngineOps`: ``Cluster``, ``SglangEngine``) or an ``EmbeddedClient``.

    ``token``: one bearer token, several (each its own tenant), or a ``{token: tenant_name}`` map;
    ``None`` (or empty) serves without authentication, everything in one tenant.
    ``max_tokens`` caps ``max_tokens`` of every request (default: the model's context);
    ``default_max_tokens`` applies to OpenAI requests that give none.
    """
    engine = engine_of(target)
    tenants = tenant_map(token)
    state = ServerState(
        engine, tenants=tenants, max_tokens=max_tokens, default_max_tokens=default_max_tokens, max_n=max_n,
        max_agents=max_agents, threads=threads, fallback_max_tokens=DEFAULT_MAX_TOKENS,
    )

    app = FastAPI(
        title="kvbaton",
        version=kvbaton.__version__,
        description="Pass KV-cache handles instead of text between LLM agents.",
    )
    app.state.kvbaton = state
    install_error_handlers(app)
    add_native_routes(app, state)
    add_openai_routes(app, state)

    @app.get("/health", response_model=p.Health, tags=["server"])
    async def health() -> p.Health:
        return p.Health(model=state.model, version=kvbaton.__version__)

    @app.get("/v1/capabilities", response_model=Capabilities, tags=["server"], responses=ERROR_RESPONSES)
    async def capabilities() -> Capabilities:
        """What the engine behind this server does exactly, corrects, recomputes or cannot do."""
        return engine.capabilities()

    @app.get("/metrics", tags=["server"], response_class=Response)
    async def metrics() -> Response:
        return Response(await state.run(state.metrics.exposition), media_type=CONTENT_TYPE)

    # Outermost first: metrics see every answer (401 and 413 included), auth runs before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(AuthMiddleware, tenants=tenants)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    return app


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
