"""The adapter core: what every framework adapter of kvbaton shares, written once.

The LangGraph adapter (the ``langgraph`` package) and the AutoGen adapter (the ``autogen``
package) keep only their framework glue; the parts below are the same for both:

- **dispatch** — call a client method from sync code (:func:`call`) or async code (:func:`acall`)
  whether the client is a :class:`kvbaton.Client` or a :class:`kvbaton.AsyncClient`;
- **the tool-call convention** — one prompt block describing the tools (:func:`render_tools`), one
  rendering of earlier calls and results, one parser (:func:`parse_tool_calls` → ``(text, calls)``);
- **the best handle** — of the handles found on a prompt's messages, the one whose KV the prompt
  reuses most (:func:`rank_handles`: longest common token prefix, latest on ties), and a call that
  falls back to plain prefill when that handle went stale (:func:`run_with_handle`), with the
  adapter's reuse policy where the client takes one, inside the run's reuse session
  (:mod:`kvbaton.scope`), and how the answer was served (:func:`reuse_report`: exact or approximate);
- **agent registration** — an agent's fixed prompt (its leading system messages) registered once
  per client, again only when it changes (:func:`register_fixed_prompt`);
- **hints** — steps-to-execution of a :class:`~kvbaton.StepGraph` sent through the client's
  ``hints()`` (:class:`HintSender`);
- **compact handle references** — what goes on a framework message: a handle without its lineage
  (:func:`compact_handle`: id, fingerprints, length, positions; a bounded size whatever the context),
  its tokens remembered in this process and otherwise asked of the engine when a choice needs them
  (:func:`handle_tokens`);
- **shared connections** — the process-wide kvbaton client an adapter object opens when it is given
  none: :mod:`kvbaton.adapters.connections`;
- **ownership** — runs as scopes, what a result references: :mod:`kvbaton.adapters.ownership`.

Invariants: only the public client API is used (client methods, :class:`~kvbaton.Handle`,
:class:`~kvbaton.StepGraph`), never an engine; cache hints (hints, implicit registrations) never
raise into the app, they are logged; a helper has one name and one shape in every adapter; every
``a``-prefixed function is the async twin of the one without, with the same arguments and result.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from kvbaton.client import AsyncClient
from kvbaton.errors import HandleNotFound, HandleReleased, IncompatibleHandle
from kvbaton.handle import Handle, common_prefix_length
from kvbaton.stepgraph import StepGraph
from kvbaton.threaded import run_blocking
from kvbaton.tools import (  # noqa: F401 (re-exported: the adapters' tool-call convention)
    TOOL_PROMPT,
    ToolCall,
    parse_tool_calls,
    render_tool_calls,
    render_tools,
    tool_result,
    with_tool_prompt,
)

log = logging.getLogger("kvbaton.adapters")

T = TypeVar("T")

# -- dispatch ---------------------------------------------------------------------------------------


def sync_client(client: Any) -> Any:
    """A synchronous client for ``client``: ``client`` itself unless it is an
    :class:`~kvbaton.AsyncClient`, then the sync client it wraps (an ``AsyncEmbeddedClient``'s
    ``client``), or None when it wraps none (e.g. ``AsyncHttpClient``)."""
    return client.blocking if isinstance(client, AsyncClient) else client


def _method(client: Any, name: str) -> Callable[..., Any]:
    fn = getattr(client, name, None)
    if fn is None:
        raise AttributeError(f"{type(client).__name__} has no {name}()")
    return fn


def _call_target(client: Any) -> Any:
    """The client :func:`call` calls for ``client`` (see :func:`sync_client`); TypeError when
    ``client`` is async-only."""
    sync = sync_client(client)
    if sync is None:
        raise TypeError(f"{type(client).__name__} is async-only: call it from async code")
    return sync


def call(client: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``client.<name>(*args, **kwargs)`` from synchronous code (an async client's wrapped sync
    client is used). AttributeError when the client has no such method, TypeError when it is
    async-only."""
    return _method(_call_target(client), name)(*args, **kwargs)


async def _ainvoke(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    return await run_blocking(fn, *args, **kwargs)  # a sync client must not block the event loop


async def acall(client: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """Async twin of :func:`call`: coroutine methods are awaited, synchronous ones run in a worker
    thread."""
    return await _ainvoke(_method(client, name), *args, **kwargs)


async def iterate_in_thread(iterator: Iterator[T]) -> AsyncIterator[T]:
    """The items of a blocking iterator (a sync client's stream), each ``next`` in a worker thread."""
    done: Any = object()
    while (item := await run_blocking(next, iterator, done)) is not done:
        yield item


@functools.lru_cache(maxsize=256)
def _takes(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def agent_kwargs(fn: Callable[..., Any], agent: str | None) -> dict[str, Any]:
    """``{"agent": agent}`` when ``agent`` is set and ``fn`` takes an ``agent`` argument (clients of
    the SDK do; wrappers and fakes may not), else ``{}``."""
    if agent is None:
        return {}
    return {"agent": agent} if _takes(getattr(fn, "__func__", fn), "agent") else {}


def reuse_kwargs(fn: Callable[..., Any], reuse: str | None) -> dict[str, Any]:
    """``{"reuse": reuse}`` when ``reuse`` is set and ``fn`` takes a ``reuse`` argument (the SDK's
    ``generate``/``generate_stream`` do; older wrappers and fakes may not), else ``{}``."""
    if reuse is None:
        return {}
    return {"reuse": reuse} if _takes(getattr(fn, "__func__", fn), "reuse") else {}


def reuse_report(result: Any) -> dict[str, Any]:
    """How a :class:`kvbaton.Result`'s prompt was served, as the adapters put it on their replies:
    ``exact`` (False: part of its K/V was reused approximately from another agent's context), the
    prompt tokens reused (approximate ones included), approximate and prefilled, and one line per
    span placed behind the prompt's prefix (``outcome``, tokens reused, ``reason``)."""
    timings = result.timings
    return {
        "exact": bool(getattr(result, "exact", True)),
        "tokens_reused": timings.tokens_reused,
        "tokens_approximate": getattr(timings, "tokens_approximate", 0),
        "tokens_prefilled": timings.tokens_prefilled,
        "segments": [{"outcome": s.outcome, "tokens_reused": s.tokens_reused, "exact": s.exact, "reason": s.reason}
                     for s in getattr(result, "segments", None) or ()],
    }


# -- the tool-call convention: kvbaton.tools (shared with the engine and the OpenAI route) ---------

# -- the best handle --------------------------------------------------------------------------------

STALE_HANDLE_ERRORS = (HandleNotFound, HandleReleased, IncompatibleHandle)
"""A handle that is released, unknown to the engine (e.g. restored after a restart) or another
model's: the call is made again without it."""

H = TypeVar("H", bound="Handle | Mapping[str, Any]")

# -- compact handle references ----------------------------------------------------------------------

LINEAGE_MEMORY = 4096
"""Handles whose tokens this process remembers for :func:`handle_tokens` (latest used kept)."""

_tokens: OrderedDict[str, tuple[int, ...]] = OrderedDict()
_tokens_lock = threading.Lock()


def remember_tokens(handle: Handle) -> None:
    """Remember the tokens of ``handle`` (from its lineage) under its id, in a bounded memory."""
    if not handle.lineage:
        return
    tokens = tuple(handle.token_ids())
    with _tokens_lock:
        _tokens[handle.id] = tokens
        _tokens.move_to_end(handle.id)
        while len(_tokens) > LINEAGE_MEMORY:
            _tokens.popitem(last=False)


def compact_handle(handle: Handle) -> dict[str, Any]:
    """The reference to ``handle`` an adapter puts on a message: its JSON without the lineage — id,
    model and tokenizer fingerprints, length, positions, placement, exactness. ``Handle.model_validate``
    reads it back and the engine checks it like any handle, so the size of a checkpointed
    conversation does not grow with every context token; the tokens are remembered here instead."""
    remember_tokens(handle)
    return handle.model_dump(mode="json", exclude={"lineage"})


def _lineage_tokens(handle: Handle | Mapping[str, Any]) -> list[int] | None:
    try:
        if isinstance(handle, Handle):
            return handle.token_ids() if handle.lineage else None
        lineage = handle.get("lineage")
        if not lineage:
            return None
        tokens: list[int] = []
        for step in lineage:
            keep = step.get("keep")
            if keep is not None:
                del tokens[keep:]
            tokens.extend(step.get("token_ids") or ())
        return tokens
    except (TypeError, AttributeError, KeyError, ValueError):
        return None


def handle_tokens(handle: Handle | Mapping[str, Any], client: Any = None) -> list[int] | None:
    """The token ids a handle covers (a :class:`~kvbaton.Handle` or its JSON dict, full or compact,
    read without validating it): from its lineage, else from this process's memory of the handles
    it saw, else — with ``client`` over an engine that describes handles — from the engine. None
    when none of them knows."""
    tokens = _lineage_tokens(handle)
    if tokens is not None:
        return tokens
    handle_id = handle.id if isinstance(handle, Handle) else handle.get("id") if isinstance(handle, Mapping) else None
    if not isinstance(handle_id, str):
        return None
    with _tokens_lock:
        known = _tokens.get(handle_id)
    if known is not None:
        return list(known)
    describe = getattr(getattr(sync_client(client), "ops", None), "describe", None)
    if describe is None:
        return None
    try:
        full = describe(handle_id)
    except Exception:  # noqa: BLE001 - released or unknown: the handle is simply not ranked by content
        return None
    remember_tokens(full)
    return full.token_ids()


def rank_handles(candidates: Sequence[H], prompt_tokens: Sequence[int] | None = None, client: Any = None) -> list[H]:
    """Candidate handles (oldest first, as they appear on the prompt) best first: the more of the
    prompt's leading tokens a handle covers, the more KV the engine reuses from it (the latest on
    ties). Handles that share no token with the prompt are left out; those whose tokens nobody
    knows (:func:`handle_tokens`) come last, latest first — the engine keeps what they share.
    Without ``prompt_tokens``: latest first."""
    latest_first = list(reversed(candidates))
    if prompt_tokens is None:
        return latest_first
    scored, unknown = [], []
    for order, handle in enumerate(latest_first):
        tokens = handle_tokens(handle, client)
        if tokens is None:
            unknown.append(handle)
            continue
        shared = common_prefix_length(tokens, prompt_tokens)
        if shared > 0:
            scored.append((-shared, order, handle))
    return [handle for *_, handle in sorted(scored, key=lambda s: s[:2])] + unknown


def best_handle(candidates: Sequence[H], prompt_tokens: Sequence[int] | None = None) -> H | None:
    """The first of :func:`rank_handles`, or None."""
    ranked = rank_handles(candidates, prompt_tokens)
    return ranked[0] if ranked else None


def rank_for_prompt(
    client: Any, candidates: Sequence[H], messages: Sequence[Any], *, tools: Any = None
) -> list[H]:
    """:func:`rank_handles` for a chat prompt; the prompt is tokenized (``client.chat_tokens``) only
    to choose between several candidates — one is taken as it is, the engine reuses what it shares."""
    tokens = call(client, "chat_tokens", messages, tools=tools) if len(candidates) > 1 else None
    return rank_handles(candidates, tokens, client)


async def arank_for_prompt(
    client: Any, candidates: Sequence[H], messages: Sequence[Any], *, tools: Any = None
) -> list[H]:
    tokens = await acall(client, "chat_tokens", messages, tools=tools) if len(candidates) > 1 else None
    if tokens is None:
        return rank_handles(candidates, tokens)
    return await run_blocking(rank_handles, candidates, tokens, client)  # may ask the engine for lineages


def run_with_handle(
    client: Any, method: str, messages: Any, handle: Any, *, agent: str | None = None, reuse: str | None = None,
    on_stale: Callable[[Any], None] | None = None, **options: Any,
) -> Any:
    """``client.<method>(messages, handle=handle, agent=agent, reuse=reuse, **options)`` (``agent`` and
    ``reuse`` only where the method takes them). A stale handle (:data:`STALE_HANDLE_ERRORS`) makes the
    same call without it — plain prefill — after ``on_stale(handle)``."""
    fn = _method(_call_target(client), method)
    options.update(agent_kwargs(fn, agent))  # its reuse session goes with it (kvbaton.scope)
    options.update(reuse_kwargs(fn, reuse))
    try:
        return fn(messages, handle=handle, **options)
    except STALE_HANDLE_ERRORS:
        if handle is None:
            raise
        if on_stale is not None:
            on_stale(handle)
        return fn(messages, **options)


async def arun_with_handle(
    client: Any, method: str, messages: Any, handle: Any, *, agent: str | None = None, reuse: str | None = None,
    on_stale: Callable[[Any], None] | None = None, **options: Any,
) -> Any:
    fn = _method(client, method)
    options.update(agent_kwargs(fn, agent))
    options.update(reuse_kwargs(fn, reuse))
    try:
        return await _ainvoke(fn, messages, handle=handle, **options)
    except STALE_HANDLE_ERRORS:
        if handle is None:
            raise
        if on_stale is not None:
            on_stale(handle)
        return await _ainvoke(fn, messages, **options)


# -- agent registration -----------------------------------------------------------------------------

# client -> {agent: the fixed prompt last registered}; weak, so a closed client's entries go with it
_registered: weakref.WeakKeyDictionary[Any, dict[str, list[dict[str, Any]]]] = weakref.WeakKeyDictionary()
_registered_lock = threading.Lock()


def leading_system(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The leading system message(s) of a chat: an agent's fixed prompt."""
    out = []
    for m in messages:
        if m.get("role") != "system":
            break
        out.append(dict(m))
    return out


def registered_prompt(client: Any, agent: str) -> list[dict[str, Any]] | None:
    """The fixed prompt last registered for ``agent`` with ``client`` through this module."""
    with _registered_lock:
        try:
            return _registered.get(client, {}).get(agent)
        except TypeError:  # not weak-referenceable: nothing remembered
            return None


def _remember(client: Any, agent: str, fixed: list[dict[str, Any]]) -> bool:
    """Record ``fixed`` as ``agent``'s registered prompt; False if it already was."""
    with _registered_lock:
        try:
            seen = _registered.setdefault(client, {})
        except TypeError:  # not weak-referenceable: register every time rather than never
            return True
        if seen.get(agent) == fixed:
            return False
        seen[agent] = fixed
        return True


def _as_messages(fixed_prompt: Sequence[Mapping[str, Any]] | str) -> list[dict[str, Any]]:
    if isinstance(fixed_prompt, str):
        return [{"role": "system", "content": fixed_prompt}]
    return [dict(m) for m in fixed_prompt]


def _supported(caps: Any, feature: str) -> bool:
    value = getattr(caps, feature, True)
    return value in ("exact", "corrected") if isinstance(value, str) else bool(value)


def supports(client: Any, feature: str) -> bool:
    """Whether the engine behind ``client`` reports ``feature`` (a :class:`kvbaton.Capabilities`
    field; "exact"/"corrected" count as support). Clients that cannot say are assumed able."""
    try:
        return _supported(call(client, "capabilities"), feature)
    except Exception:  # noqa: BLE001 - no capabilities() (older server, fake client): assume it can
        return True


async def asupports(client: Any, feature: str) -> bool:
    try:
        return _supported(await acall(client, "capabilities"), feature)
    except Exception:  # noqa: BLE001
        return True


def register_agent(
    client: Any, agent: str, fixed_prompt: Sequence[Mapping[str, Any]] | str, *, prefill: bool = False
) -> Any:
    """Register ``agent``'s fixed prompt (system messages, or a string) with ``client`` now; the
    client's errors are raised. Remembered, so :func:`register_fixed_prompt` does not repeat it.
    A client without ``register_agent`` is skipped (None)."""
    fixed = _as_messages(fixed_prompt)
    info = call(client, "register_agent", agent, fixed, prefill=prefill) if _can_register(client) else None
    _remember(client, agent, fixed)
    return info


async def aregister_agent(
    client: Any, agent: str, fixed_prompt: Sequence[Mapping[str, Any]] | str, *, prefill: bool = False
) -> Any:
    fixed = _as_messages(fixed_prompt)
    info = await acall(client, "register_agent", agent, fixed, prefill=prefill) if _can_register(client) else None
    _remember(client, agent, fixed)
    return info


def _can_register(client: Any) -> bool:
    return getattr(client, "register_agent", None) is not None


def _due(client: Any, agent: str | None, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The fixed prompt to register now for ``agent``: new or changed for ``client``; [] if none."""
    if not agent or client is None or not _can_register(client):
        return []
    fixed = leading_system(messages)
    return fixed if fixed and _remember(client, agent, fixed) else []


def register_fixed_prompt(client: Any, agent: str | None, messages: Sequence[Mapping[str, Any]]) -> None:
    """Register ``agent``'s fixed prompt — the leading system messages of ``messages`` — with
    ``client`` once (again only when it changes), if its engine does workflow eviction. Never
    raises: a failure is logged (a cache hint must never break the app) and not retried."""
    fixed = _due(client, agent, messages)
    if not fixed or not supports(client, "workflow_eviction"):
        return
    try:
        call(client, "register_agent", agent, fixed)
    except Exception as exc:  # noqa: BLE001
        log.warning("kvbaton: registering agent %r failed: %s", agent, exc)


async def aregister_fixed_prompt(client: Any, agent: str | None, messages: Sequence[Mapping[str, Any]]) -> None:
    fixed = _due(client, agent, messages)
    if not fixed or not await asupports(client, "workflow_eviction"):
        return
    try:
        await acall(client, "register_agent", agent, fixed)
    except Exception as exc:  # noqa: BLE001
        log.warning("kvbaton: registering agent %r failed: %s", agent, exc)


# -- hints ------------------------------------------------------------------------------------------


class HintSender:
    """Sends the steps-to-execution of one :class:`~kvbaton.StepGraph` through a client's
    ``client.hints(graph, running=..., finished=...)``.

    Never raises into the app: a failing call is logged on ``logger``; a client without ``hints()``
    is noted once and not asked again (``enabled`` turns False). The synchronous sender reads the
    graph under ``lock`` (an adapter that learns edges at run time changes it under the same lock);
    the async one sends through a sync client from a worker thread under the lock as well, through
    an :class:`~kvbaton.AsyncClient` without it."""

    def __init__(self, graph: StepGraph, client: Any = None, *, enabled: bool = True,
                 lock: threading.RLock | None = None, logger: logging.Logger | None = None) -> None:
        self.graph = graph
        self.client = client
        self.enabled = enabled
        self.lock = lock if lock is not None else threading.RLock()
        self.log = logger or log

    def _ready(self) -> bool:
        if not self.enabled or self.client is None:
            return False
        target = self.client if isinstance(self.client, AsyncClient) else sync_client(self.client)
        if getattr(target, "hints", None) is None:
            self.log.info("%s takes no hints; none are sent", type(self.client).__name__)
            self.enabled = False
        return self.enabled

    def send(self, running: Sequence[str], finished: Sequence[str]) -> bool:
        """Send the hints now; True when they went out."""
        if not self._ready():
            return False
        try:
            with self.lock:
                call(self.client, "hints", self.graph, running=tuple(running), finished=tuple(finished))
            return True
        except Exception as exc:  # noqa: BLE001 - hints are advisory
            self.log.warning("kvbaton hints failed: %s", exc)
            return False

    async def asend(self, running: Sequence[str], finished: Sequence[str]) -> bool:
        if not isinstance(self.client, AsyncClient):
            return await run_blocking(self.send, running, finished)
        if not self._ready():
            return False
        try:
            await acall(self.client, "hints", self.graph, running=tuple(running), finished=tuple(finished))
            return True
        except Exception as exc:  # noqa: BLE001
            self.log.warning("kvbaton hints failed: %s", exc)
            return False


__all__ = [
    "STALE_HANDLE_ERRORS",
    "TOOL_PROMPT",
    "HintSender",
    "ToolCall",
    "acall",
    "agent_kwargs",
    "arank_for_prompt",
    "aregister_agent",
    "aregister_fixed_prompt",
    "arun_with_handle",
    "asupports",
    "best_handle",
    "call",
    "compact_handle",
    "handle_tokens",
    "iterate_in_thread",
    "leading_system",
    "parse_tool_calls",
    "rank_for_prompt",
    "rank_handles",
    "register_agent",
    "register_fixed_prompt",
    "registered_prompt",
    "render_tool_calls",
    "render_tools",
    "reuse_kwargs",
    "remember_tokens",
    "reuse_report",
    "run_with_handle",
    "supports",
    "sync_client",
    "tool_result",
    "with_tool_prompt",
]

# Moved to kvbaton.adapters.connections (issue 41); kept importable from here, with a DeprecationWarning,
# for one release: ``from kvbaton.adapters.core import shared_connection, register_connection``.
_MOVED = {"shared_connection": "kvbaton.adapters.connections", "register_connection": "kvbaton.adapters.connections"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(f"kvbaton.adapters.core.{name} moved to {_MOVED[name]}.{name}; the old import is removed in "
                      "the next release", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
