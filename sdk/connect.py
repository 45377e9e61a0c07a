"""Opening a client: :func:`connect` and :func:`aconnect` (``kvbaton.connect``, ``kvbaton.aconnect``).

The one place that knows every backend: the target picks the embedded engine, a server over HTTP,
or SGLang. The backends are imported when first chosen, so ``import kvbaton`` stays light (no
httpx, no engine) and the client interface (:mod:`kvbaton.client`) depends on none of them.
"""

from __future__ import annotations

import os
from typing import Any

from .client import AsyncClient, Client
from .errors import InvalidRequest


def _is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def _no_token(token: str | None) -> None:
    if token is not None:
        raise InvalidRequest("token applies to a server URL target, not to the embedded engine")


def _http_options(target: str, token: str | None, model: str | None, options: dict[str, Any]) -> dict[str, Any]:
    unknown = set(options) - {"timeout", "connect_timeout", "headers", "max_retries", "max_retry_wait"}
    if model is not None or unknown:
        names = sorted(unknown | ({"model"} if model is not None else set()))
        raise InvalidRequest(
            f"options {names} configure an embedded engine; the server at {target} chose its model and engine options"
        )
    return {"token": token if token is not None else os.environ.get("KVBATON_TOKEN") or None, **options}


def _wants_sglang(target: str | None, token: str | None, options: dict[str, Any]) -> bool:
    """``engine="sglang"`` (a name; an engine object passes through to the embedded client)."""
    engine = options.get("engine")
    if not isinstance(engine, str):
        return False
    del options["engine"]
    if engine == "kvbaton":
        return False
    if engine != "sglang":
        raise InvalidRequest(f"unknown engine {engine!r}: use 'kvbaton' (default) or 'sglang'")
    if target not in (None, "embedded"):
        raise InvalidRequest("engine='sglang' runs in this process; a server at a URL chose its own engine")
    _no_token(token)
    return True


def connect(
    target: str | None = None, *, model: str | None = None, token: str | None = None, **options: Any
) -> Client:
    """Open a kvbaton client.

    ``connect()`` starts an embedded engine with the default model in this process;
    ``connect(model="/path/to/hf-checkpoint")`` another local model. Engine options
    (``dtype``, ``device``, ``kv_budget``, ``block_size``, ``prefill_chunk``, ``max_batch_tokens``)
    pass through.

    ``connect("http://host:8470", token=...)`` talks to a ``kvbaton serve`` server instead
    (token defaults to ``$KVBATON_TOKEN``; options ``timeout``, ``connect_timeout``, ``headers``,
    ``max_retries`` and ``max_retry_wait``: see :class:`~kvbaton.http.HttpClient`).

    ``connect(engine="sglang", model="/path/to/hf-checkpoint")`` runs SGLang with the kvbaton plugin
    in this process instead of kvbaton's engine (needs sglang==0.5.23 and a GPU; docs/sglang.md).
    """
    if _wants_sglang(target, token, options):
        from .sglang_client import SglangClient

        return SglangClient(model=model, **options)
    if target is None or target == "embedded":
        from .embedded import EmbeddedClient

        _no_token(token)
        return EmbeddedClient(model=model, **options)
    if _is_url(target):
        from .http import HttpClient

        return HttpClient(target, **_http_options(target, token, model, options))
    raise InvalidRequest(
        f"unsupported connect target {target!r}: use connect() for the embedded engine or an http(s):// URL"
    )


async def aconnect(
    target: str | None = None, *, model: str | None = None, token: str | None = None, **options: Any
) -> AsyncClient:
    """The asynchronous :func:`connect`: ``client = await kvbaton.aconnect("http://host:8470")``.

    The embedded engine is built in a worker thread (loading the model blocks)."""
    if _wants_sglang(target, token, options):
        from .sglang_client import AsyncSglangClient

        return await AsyncSglangClient.start(model, **options)
    if target is None or target == "embedded":
        from .embedded import AsyncEmbeddedClient

        _no_token(token)
        return await AsyncEmbeddedClient.start(model, **options)
    if _is_url(target):
        from .http import AsyncHttpClient

        return AsyncHttpClient(target, **_http_options(target, token, model, options))
    raise InvalidRequest(
        f"unsupported connect target {target!r}: use aconnect() for the embedded engine or an http(s):// URL"
    )
