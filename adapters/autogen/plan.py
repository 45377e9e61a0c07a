"""What :func:`~kvbaton.adapters.autogen.instrument` does with each model client it finds.

A :class:`~kvbaton.adapters.autogen.KvbatonChatCompletionClient` is kept (tagged with its agent,
moved to the client given to ``instrument``, if any); an ``OpenAIChatCompletionClient`` pointed at a
``kvbaton serve`` server becomes a kvbaton client on that server with its sampling settings; any
other client is replaced only when ``instrument`` was given a client, else left as it is. Each
decision comes with the line that says so (``obj.kvbaton.changes``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvbaton.client import AsyncClient, Client

from ..connections import default_target, is_openai_key, shared_connection, target_of
from .client import KvbatonChatCompletionClient

logger = logging.getLogger("kvbaton.adapters.autogen")

SETTINGS = ("max_tokens", "temperature", "top_p", "seed", "stop")
"""Settings of a foreign model client's configuration that a kvbaton model client takes over."""


def _config(model_client: Any) -> dict[str, Any]:
    try:
        return dict(model_client.dump_component().config)
    except Exception:  # noqa: BLE001 - a client that cannot dump itself has no settings to carry
        return {}


def _settings(model_client: Any) -> dict[str, Any]:
    config = _config(model_client)
    return {k: config[k] for k in SETTINGS if config.get(k) is not None}


def _secret(value: Any) -> str | None:
    value = value.get_secret_value() if hasattr(value, "get_secret_value") else value
    return value if isinstance(value, str) and value else None


def _kvbaton_server(model_client: Any) -> Client | None:
    """The kvbaton server an OpenAI-SDK model client is pointed at, as a kvbaton client (its key is
    the token unless it is an OpenAI key; ``$KVBATON_TOKEN`` first), or None when it points
    elsewhere (``api.openai.com``, another server) — asked with one ``capabilities`` call."""
    config = _config(model_client)
    base = config.get("base_url")
    if not isinstance(base, str) or not base.startswith(("http://", "https://")) or "api.openai.com" in base:
        return None
    key = _secret(config.get("api_key"))
    token = os.environ.get("KVBATON_TOKEN") or (key if key and not is_openai_key(key) else None)
    try:
        backend = shared_connection(default_target(base), None, token)
        backend.capabilities()
    except Exception as exc:  # noqa: BLE001 - not a kvbaton server (or down): the client is left alone
        logger.debug("%s is not a kvbaton server: %s", base, exc)
        return None
    return backend  # type: ignore[return-value]


def plan(
    existing: Any, backend: Client | AsyncClient | None, agent: str, options: dict[str, Any]
) -> tuple[KvbatonChatCompletionClient | None, str]:
    """What instrument() does with one model client: the kvbaton model client to use (None: keep
    ``existing``) and the line that says so. ``backend``: the client given to instrument()."""
    name = type(existing).__name__
    if isinstance(existing, KvbatonChatCompletionClient):
        own = backend if backend is not None else existing.kvbaton_client
        config = {**existing.dump_component().config, **options, "agent": agent, "target": target_of(own)}
        moved = "" if own is existing.kvbaton_client else f", moved to {target_of(own)}"
        return KvbatonChatCompletionClient(own, **config), f"{agent}: KvbatonChatCompletionClient kept{moved}"
    if backend is None:
        backend = _kvbaton_server(existing)
        if backend is None:
            return None, f"{agent}: {name} kept as it is (not on kvbaton: pass client= to replace it)"
    settings = {**_settings(existing), **options}
    kept = ", ".join(f"{k}={v!r}" for k, v in settings.items()) or "no settings"
    return (KvbatonChatCompletionClient(backend, agent=agent, **settings),
            f"{agent}: {name} replaced by KvbatonChatCompletionClient on {target_of(backend)} ({kept})")


def resolve_client(client: Client | AsyncClient | str | None) -> Client | AsyncClient | None:
    if isinstance(client, Client | AsyncClient):
        return client
    if isinstance(client, str):
        return shared_connection(client)
    return None
