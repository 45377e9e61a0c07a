"""``kvbaton serve --engine sglang``: kvbaton's HTTP server in front of SGLang with the plugin."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import kvbaton

log = logging.getLogger("kvbaton.sglang")


def serve(
    host: str,
    port: int,
    *,
    model: str | None,
    token: str | Sequence[str] | None = None,
    log_level: str = "info",
    engine_options: dict[str, Any] | None = None,
    **app_options: Any,
) -> None:
    """Like :func:`kvbaton.backend.server.serve` (same endpoints, auth and limits), over an
    :class:`~.engine.SglangEngine`; ``GET /v1/capabilities`` reports what SGLang does differently."""
    from kvbaton.backend.server import create_app
    from kvbaton.backend.server.app import check_serve_options, run_app
    from kvbaton.backend.server.listener import DEFAULT_CLIENT_TIMEOUT_S, bind, bound_port

    from .engine import SglangEngine

    tokens = [token] if isinstance(token, str) else list(token or [])
    client_timeout = app_options.pop("client_timeout", DEFAULT_CLIENT_TIMEOUT_S)
    check_serve_options(host, tokens, client_timeout=client_timeout, **app_options)
    sock = bind(host, port)  # before SGLang loads: a taken port fails at once
    try:
        engine = SglangEngine(model, **(engine_options or {}))
    except BaseException:
        sock.close()
        raise
    try:
        app = create_app(engine, token=tokens or None, **app_options)
        log.info("kvbaton %s serving %s with SGLang (eviction %s) on http://%s:%d", kvbaton.__version__,
                 app.state.kvbaton.model, engine.eviction, host, bound_port(sock))
        run_app(app, sock, log_level=log_level, client_timeout=client_timeout)
    finally:
        sock.close()
        engine.close()
