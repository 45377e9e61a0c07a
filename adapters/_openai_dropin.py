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
- with ``wrap(..., reuse=...)`` the requests carry ``X-Kvbaton-Reuse`` (else the server's ``--reuse``
  decides);
- the handle id the server returns (``X-Kvbaton-Handle``) is put on the AIMessage as
  ``additional_kwargs["kvbaton"] = {"handle": {"id": ...}, "agent": ...}``, and whether the answer is
  exact (``X-Kvbaton-Approximate``) as ``response_metadata["kvbaton"] = {"exact": ...}`` (whole
  answers; a stream's headers come before it is known).

The patch is process-wide but inert outside wrapped runs with a ``base_url`` (it checks a ContextVar
first), and other hosts are never touched. The server reuses each agent's latest handle by itself;
hints and agent registrations go to it through a plain kvbaton HTTP client (:func:`control_client`).
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpx

from ._langchain_model import ACTIVE_RUN
from ._langgraph_models import OPENAI_BASE, normalize_base_url
from .core import is_openai_key

__all__ = ["CURRENT_CALL", "OPENAI_BASE", "CallTag", "control_client", "install", "normalize_base_url"]


@dataclass
class CallTag:
    agent: str | None
    handle: str | None = None
    exact: bool | None = None  # from X-Kvbaton-Approximate (whole answers); None: not known (a stream)
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
        if response.status_code == 200 and not response.headers.get("content-type", "").startswith("text/event-stream"):
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
    from kvbaton.client import connect

    return connect(normalize_base_url(base_url)[: -len("/v1")], token=token, timeout=timeout)
