"""The kvbaton server: the engine behind HTTP.

``create_app(engine)`` builds the FastAPI app; ``serve(...)`` (``kvbaton serve``) runs it under
uvicorn. Endpoints (docs/api.md lists them all, rendered from the app's OpenAPI schema):

- the native handle API under ``/v1/kv/...``: one route per operator of ``kvbaton.wire.OPERATIONS``
  (the table the SDK's HTTP client is built from; ``/v1/capabilities`` is one of its rows), plus
  ``release_all`` and ``events/stream``; generation streams as server-sent events (``event: chunk``
  ..., then ``event: result``);
- OpenAI-compatible ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions`` and
  ``/v1/responses``, with the ``kvbaton`` body extension / ``X-Kvbaton-Agent`` header to reuse
  handles, and ``DELETE /v1/sessions/{id}``;
- ``/health``, ``/metrics`` (Prometheus text) and ``/dashboard``.

Every error answers ``{"error": {"code": ..., "message": ...}}`` with the SDK's error codes and the
status of the error's class, 4xx for anything the request did wrong. Engine calls block: they run
in worker threads, and streams are pulled one step per worker call (a request's choices at once),
so the event loop never waits on the model; on SIGTERM the server drains (generations end at their
next token) before it exits. ``allowed_origins`` opts into CORS for browsers.

Security: with tokens configured, every request needs ``Authorization: Bearer <token>``; each token
is a tenant, and handles are visible only to the tenant that made them (any other tenant gets the
same 404 as for an unknown id); each tenant is held to quotas of live handles and KV bytes (429
``quota_exceeded``), and idle handles may expire (``handle_ttl``). ``/health`` is 503 while the engine
cannot serve (every worker down), and so are the requests that fail meanwhile.

Modules, one concept each: ``args`` (``ServerArgs``: every option, the CLI generated from it), ``app``
(create_app, serve), ``state`` (what the endpoints share),
``tenancy`` (tenants, handle owners, agent slots), ``errors`` (the error schema and handlers),
``middleware`` (metrics, auth, body limit, last-resort errors), ``accesslog`` (access and throughput
lines), ``metrics`` (Prometheus), ``sse`` (the one streaming driver), ``native`` (``/v1/kv`` routes
from the wire table), ``protocol`` (the server's own bodies, the OpenAI answers included), ``openai``
(OpenAI routes), ``openai_fields``, ``openai_messages`` and ``openai_tools`` (which OpenAI fields are
honoured; OpenAI messages translated for the chat template; tool calls streamed as deltas).
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy, as kvbaton.backend is: the command line imports ``.args`` (ServerArgs) to build its parser,
# which must load neither torch nor the engine.
_EXPORTS = {
    "DEFAULT_MAX_TOKENS": ".args", "ServerArgs": ".args", "create_app": ".app", "engine_of": ".app", "serve": ".app",
    "error_response": ".errors", "Metrics": ".metrics", "EventStreamResponse": ".sse", "ServerState": ".state",
    "SINGLE_TENANT": ".tenancy", "AgentSlots": ".tenancy", "Owners": ".tenancy", "tenant_id": ".tenancy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
