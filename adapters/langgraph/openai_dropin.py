"""Mode 2 of the LangGraph adapter: apps that build ``ChatOpenAI`` (or any OpenAI-SDK model) unchanged.

Inside a run of a graph wrapped with ``wrap(app, base_url=...)``:

- each chat-model call is tagged with its agent: the wrapper's callback sets :data:`CURRENT_CALL`
  on ``on_chat_model_start`` (same context as the call), and a patched ``httpx``/``httpx2`` send adds
  ``X-Kvbaton-Agent: <node>`` to requests that go to ``base_url``;
- with ``redirect_openai=True`` (opt-in), requests to ``https://api.openai.com/v1`` are redirected to
  ``base_url``, so an app that never set a base URL reaches the kvbaton server too;
- the app's OpenAI credentials never reach the kvbaton server: a request to ``base_url`` carries
  the kvbaton ``token`` (``wrap(token=...)``, default ``$KVBATON_TOKEN``) as its ``Authorization``,
  or, without one, no ``Authorization`` at all when the request was redirected or its key is an
  OpenAI key (``$OPENAI_API_KEY``, or any ``sk-...`` key); a key the app deliberately set for the
  server (``ChatOpenAI(base_url=<server>, api_key=<kvbaton token>)``) is kept;
- every request carries ``X-Kvbaton-Session: <thread_id>`` (a per-invocation id without one), so the
  server keeps each session's retained handles apart (``app.batch`` of two threads never collide);
- the requests carry ``X-Kvbaton-Reuse: <wrap(..., reuse=...)>`` (default ``auto``, the adapter's
  policy; ``reuse=None``: none, the server's ``--reuse`` decides);
- the server retains each agent's latest handle per session: :func:`release_sessions` ends the
  sessions the wrapper no longer needs (``DELETE /v1/sessions/{id}``);
- the handle id the server returns (``X-Kvbaton-Handle``) is put on the AIMessage as
  ``additional_kwargs["kvbaton"] = {"handle": {"id": ...}, "agent": ...}``, and whether the answer is
  exact (``X-Kvbaton-Approximate``, on streamed answers too: the server computes the prompt before
  it answers) as ``response_metadata["kvbaton"] = {"exact": ...}``.

The patch is process-wide but inert outside wrapped runs with a ``base_url`` (it checks a ContextVar
first), and other hosts are never touched. The server reuses each agent's latest handle by itself;
hints and agent registrations go to it through a plain kvbaton HTTP client (:func:`control_client`).

Where those calls go is decided once, at ``wrap``, from the chat models found on the app's nodes
(:func:`route`): a URL, or :class:`~kvbaton.errors.InvalidRequest` naming what is missing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
from kvbaton.errors import InvalidRequest

from ..connections import is_openai_key
from .chat_model import ACTIVE_RUN
from .models import OPENAI_BASE, FoundModel, normalize_base_url

__all__ = ["CURRENT_CALL", "OPENAI_BASE", "CallTag", "arelease_sessions", "control_client", "install",
           "normalize_base_url", "release_sessions", "route"]

log = logging.getLogger("kvbaton.adapters.langgraph")
SESSION_TIMEOUT_S = 30.0


@dataclass
class CallTag:
    agent: str | None
    handle: str | None = None
    exact: bool | None = None  # from X-Kvbaton-Approximate; None: not known (no answer yet)
    reached: bool = False  # a request of this call went to the kvbaton server


CURRENT_CALL: ContextVar[CallTag | None] = ContextVar("kvbaton_openai_call", default=None)

_installed = False
_install_lock = threading.Lock()


def _target(request: Any) -> tuple[Any, CallTag | None] | None:
    run = ACTIVE_RUN.get()
    wrapper = getattr(run, "wrapper", None)
    base = getattr(wrapper, "base_url", None)
    if not base:
        return None
    url = str(request.url)
    redirected = False
    if getattr(wrapper, "redirect_openai", False) and url.startswith(OPENAI_BASE) and not base.startswith(OPENAI_BASE):
        request.url = type(request.url)(base + url[len(OPENAI_BASE):])
        request.headers["host"] = request.url.netloc.decode("ascii")
        url, redirected = str(request.url), True
    if not url.startswith(base):
        return None
    token = getattr(wrapper, "token", None)
    if token:
        request.headers["authorization"] = f"Bearer {token}"
    elif redirected or is_openai_key(request.headers.get("authorization")):
        request.headers.pop("authorization", None)  # the app's OpenAI key is OpenAI's business, not the server's
    tag = CURRENT_CALL.get()
    if tag is not None:
        tag.reached = True
        if tag.agent:
            request.headers["x-kvbaton-agent"] = tag.agent
    session = getattr(run, "session", None)
    if session:
        request.headers["x-kvbaton-session"] = session
    reuse = getattr(wrapper, "reuse", None)
    if reuse and "x-kvbaton-reuse" not in request.headers:
        request.headers["x-kvbaton-reuse"] = reuse
    return wrapper, tag


def _after(found: tuple[Any, CallTag | None] | None, response: Any) -> None:
    if found is not None and found[1] is not None:
        handle = response.headers.get("x-kvbaton-handle")
        if handle:
            found[1].handle = handle
        if response.status_code == 200:  # a stream's headers say it too (the server primes it first)
            found[1].exact = response.headers.get("x-kvbaton-approximate", "").lower() != "true"


def _patch(module: Any) -> None:
    sync_send = module.Client.send
    async_send = module.AsyncClient.send

    def send(self: Any, request: Any, **kwargs: Any) -> Any:
        found = _target(request)
        response = sync_send(self, request, **kwargs)
        _after(found, response)
        return response

    async def asend(self: Any, request: Any, **kwargs: Any) -> Any:
        found = _target(request)
        response = await async_send(self, request, **kwargs)
        _after(found, response)
        return response

    module.Client.send = send
    module.AsyncClient.send = asend


def install() -> None:
    """Patch ``Client.send`` / ``AsyncClient.send`` of ``httpx`` and, where installed, ``httpx2``
    (which openai>=3 uses) once (see the module docstring)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _patch(httpx)
        try:
            import httpx2
        except ImportError:
            pass
        else:
            _patch(httpx2)
        _installed = True


def control_client(base_url: str, token: str | None = None, timeout: float = 10.0) -> Any:
    """The wrapper's client for control calls (hints, agent registration) to a ``kvbaton serve``:
    a :class:`kvbaton.Client` over HTTP (``POST /v1/kv/hints``, ``POST /v1/kv/agents``)."""
    from kvbaton.connect import connect

    return connect(normalize_base_url(base_url)[: -len("/v1")], token=token, timeout=timeout)


def _session_requests(base_url: str | None, token: str | None,
                      sessions: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    urls = [f"{base_url}/sessions/{quote(s, safe='')}" for s in sorted(sessions)] if base_url else []
    return urls, ({"authorization": f"Bearer {token}"} if token else {})


def _released(url: str, response: Any) -> int:
    if response.status_code != 200:
        log.warning("kvbaton: releasing the server session %s failed: HTTP %s", url, response.status_code)
        return 0
    return int(response.json().get("released", 0))


def release_sessions(base_url: str | None, token: str | None, sessions: Iterable[str]) -> int:
    """Release what the kvbaton server at ``base_url`` (a ``/v1`` URL; None: nothing to do) retains in each of
    ``sessions`` (``DELETE /v1/sessions/{id}``); how many handles it released. Never raises: a failure is
    logged, and the server's ``--handle-ttl`` and slot bound still end what is left."""
    urls, headers = _session_requests(base_url, token, sessions)
    if not urls:
        return 0
    released = 0
    try:
        with httpx.Client(headers=headers, timeout=SESSION_TIMEOUT_S) as http:
            for url in urls:
                released += _released(url, http.delete(url))
    except Exception as exc:  # noqa: BLE001 - cleanup never breaks the app
        log.warning("kvbaton: releasing server sessions failed: %s", exc)
    return released


async def arelease_sessions(base_url: str | None, token: str | None, sessions: Iterable[str]) -> int:
    urls, headers = _session_requests(base_url, token, sessions)
    if not urls:
        return 0
    released = 0
    try:
        async with httpx.AsyncClient(headers=headers, timeout=SESSION_TIMEOUT_S) as http:
            for url in urls:
                released += _released(url, await http.delete(url))
    except Exception as exc:  # noqa: BLE001
        log.warning("kvbaton: releasing server sessions failed: %s", exc)
    return released


def route(models: list[FoundModel], base_url: str | None, redirect_openai: bool, token: str | None) -> str | None:
    """Where mode 2 sends the app's OpenAI-SDK calls (a ``/v1`` URL), or None when every chat model
    found runs on kvbaton already; InvalidRequest when a model cannot be routed, naming what is
    missing. ``base_url`` defaults to ``$KVBATON_URL`` (unless only KvbatonChatModels were found);
    without either, the URL the app's OpenAI models already use is taken if it is a kvbaton server
    (one ``capabilities`` call)."""
    given = base_url or os.environ.get("KVBATON_URL")
    base = normalize_base_url(given) if given else None
    for found in models:
        if found.kind == "other":
            raise InvalidRequest(
                f"wrap(app): node {found.node!r} uses {found.name}, which kvbaton cannot serve: use KvbatonChatModel "
                "(or ChatOpenAI against a kvbaton server)"
            )
    openai = [f for f in models if f.kind == "openai"]
    if not openai:
        # $KVBATON_URL alone does not divert an app whose KvbatonChatModels say where they run
        return base if base_url or not any(f.kind == "kvbaton" for f in models) else None
    if base is None:
        targets = {f.base_url for f in openai}
        first = openai[0]
        if len(targets) > 1 or first.base_url == OPENAI_BASE:
            raise InvalidRequest(
                f"wrap(app): node {first.node!r} calls {first.name} at {first.base_url}, not a kvbaton server: "
                "pass wrap(app, base_url=<kvbaton serve URL>, redirect_openai=True) (or set KVBATON_URL), or build "
                "the model with base_url=<kvbaton serve URL>, or use KvbatonChatModel"
            )
        base = first.base_url
        _check_server(base, token, first)
    for found in openai:
        if found.base_url == base or (found.base_url == OPENAI_BASE and redirect_openai):
            continue
        if found.base_url == OPENAI_BASE:
            raise InvalidRequest(
                f"wrap(app): node {found.node!r} calls {found.name} at {OPENAI_BASE}: pass redirect_openai=True to "
                f"send its calls to the kvbaton server at {base} (its OpenAI key is not sent there), or build the "
                f"model with base_url={base!r}"
            )
        raise InvalidRequest(
            f"wrap(app): node {found.node!r} calls {found.name} at {found.base_url}, not the kvbaton server at {base}"
        )
    return base


def _check_server(base: str, token: str | None, found: FoundModel) -> None:
    """Refuse a URL that is not a kvbaton server (a plain OpenAI-compatible one takes no handles)."""
    probe = control_client(base, token)
    try:
        probe.capabilities()
    except Exception as exc:  # noqa: BLE001 - whatever the reason, it is no kvbaton server to use
        raise InvalidRequest(
            f"wrap(app): node {found.node!r} calls {found.name} at {base}, which does not answer as a kvbaton server "
            f"({exc}); pass base_url=<kvbaton serve URL>"
        ) from exc
    finally:
        probe.close()
