"""Shared connections: the kvbaton client an adapter object opens when it is given none.

``KvbatonChatModel()``, a loaded AutoGen component or a ``KvbatonChatCompletionClient(target=...)``
attach to one process-wide connection per target (``"embedded"`` or a ``kvbaton serve`` URL), model
and token (:func:`shared_connection`), opened on first use and closed at exit; a caller's own
client can take that place (:func:`register_connection`). Also: where an adapter connects when told
nothing (:func:`default_target`), the target a live client names (:func:`target_of`), which key never
goes to a kvbaton server (:func:`is_openai_key`) and the model a client serves (:func:`served_model`).

Invariants: one connection per key; a connection this module opened is closed at exit, a
registered one is its caller's.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from kvbaton.client import AsyncClient, Client
from kvbaton.errors import ModelNotFound

from .core import call

_connections: dict[tuple[str, str | None, str | None], Client | AsyncClient] = {}
_connections_lock = threading.Lock()


def register_connection(
    client: Client | AsyncClient | None, target: str = "embedded", model: str | None = None
) -> None:
    """Make ``client`` the connection that adapter objects naming ``(target, model)`` attach to in this
    process (``load_component`` of an ``"embedded"`` config then reuses this engine instead of loading
    another). ``None`` forgets the registered connection (it is not closed: it is the caller's)."""
    key = (target, model if target == "embedded" else None, None)  # a server's model is its own
    with _connections_lock:
        if client is None:
            _connections.pop(key, None)
        else:
            _connections[key] = client


def shared_connection(
    target: str = "embedded", model: str | None = None, token: str | None = None
) -> Client | AsyncClient:
    """The process-wide connection for ``(target, model, token)`` (``target``: ``"embedded"`` or a
    ``kvbaton serve`` URL), opened with ``kvbaton.connect`` on first use and closed at exit. A server
    chose its model: there ``model`` is only checked (``ModelNotFound`` when it serves another), and
    one connection per URL and token serves every model object naming it."""
    embedded = target == "embedded"
    key = (target, model if embedded else None, token)
    with _connections_lock:
        client = _connections.get(key)
        if client is None:
            from kvbaton.connect import connect

            client = connect(model=model) if embedded else connect(target, token=token)
            _connections[key] = client
            _opened.append(client)
    if not embedded and model is not None:
        served = served_model(client, default="")
        if served != model:
            raise ModelNotFound(f"the kvbaton server at {target} serves {served!r}, not {model!r}")
    return client


def open_connection(
    target: str = "embedded", model: str | None = None, token: str | None = None
) -> Client | AsyncClient | None:
    """The process-wide connection for ``(target, model, token)`` if one is open (or registered)
    already, else None: a lookup, no I/O (adapter objects are built cheaply and connect on first use)."""
    with _connections_lock:
        return _connections.get((target, model if target == "embedded" else None, token))


_opened: list[Any] = []  # the connections this module opened (registered ones are their callers')


@atexit.register
def _close_opened() -> None:
    while _opened:
        try:
            _opened.pop().close()
        except Exception:  # noqa: BLE001 - at exit, a failing close must not hide the others
            pass


def is_openai_key(key: str | None) -> bool:
    """Whether ``key`` (a bare key or an ``Authorization`` value) is an OpenAI API key: ``sk-...`` or
    ``$OPENAI_API_KEY``. Adapters never send one to a kvbaton server."""
    if not key:
        return False
    key = key.removeprefix("Bearer ").strip()
    env = os.environ.get("OPENAI_API_KEY")
    return key.startswith("sk-") or (bool(env) and key == env)


def default_target(base_url: str | None = None) -> str:
    """Where an adapter object given no client connects: ``base_url``, else ``$KVBATON_URL``, else
    the embedded engine (``"embedded"``). A URL is given without a trailing ``/v1``."""
    url = base_url or os.environ.get("KVBATON_URL") or ""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url or "embedded"


def target_of(client: Client | AsyncClient) -> str:
    """The config target of a live client: its server URL, or ``"embedded"``."""
    url = getattr(client, "base_url", None)
    return str(url) if isinstance(url, str) and url.startswith(("http://", "https://")) else "embedded"


def served_model(client: Any, default: str = "kvbaton") -> str:
    """The name of the model the engine behind ``client`` serves (its stats), or ``default`` when
    the client cannot say."""
    try:
        return str(call(client, "stats").model)
    except Exception:  # noqa: BLE001 - an async-only or fake client: the name is informative only
        return default


__all__ = [
    "default_target",
    "is_openai_key",
    "open_connection",
    "register_connection",
    "served_model",
    "shared_connection",
    "target_of",
]
