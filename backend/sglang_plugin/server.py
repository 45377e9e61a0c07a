"""``kvbaton serve --engine sglang``: kvbaton's HTTP server in front of SGLang with the plugin."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import kvbaton
from kvbaton.serverconf import check_bind

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
    import uvicorn
    from kvbaton.backend.server import create_app

    from .engine import SglangEngine

    tokens = [token] if isinstance(token, str) else list(token or [])
    check_bind(host, tokens)
    engine = SglangEngine(model, **(engine_options or {}))
    try:
        app = create_app(engine, token=tokens or None, **app_options)
        log.info("kvbaton %s serving %s with SGLang (eviction %s) on http://%s:%d", kvbaton.__version__,
                 engine.loaded.name, engine.eviction, host, port)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, access_log=False)
    finally:
        engine.close()
