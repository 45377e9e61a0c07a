"""The wrapper of a compiled LangGraph app: :func:`wrap` and :class:`LangGraphApp`.

``wrap(app, client)`` finds the chat models the app's nodes use (:mod:`.models`) and routes them
through kvbaton (``KvbatonChatModel`` as it is; an OpenAI-SDK model through mode 2, :mod:`.openai_dropin`)
or refuses, reads the Agent Step Graph from ``app.builder`` (:mod:`.graph`), and returns a Runnable
that delegates to the app. Each call runs under a :class:`~kvbaton.adapters.langgraph.run.Run` (hints
before each step) and is an ownership scope (:mod:`kvbaton.adapters.ownership`): what its result
(with a checkpointer: its thread's latest checkpoint) references is held per ``thread_id`` until the
thread's next run supersedes it, at most ``max_retained_handles`` per thread (the oldest released
first); the rest is released when the call ends. In mode 2 the server holds the handles, per session
(the thread): a run without a ``thread_id`` has a session of its own, released (``DELETE
/v1/sessions/{id}``) when the next such run ends; ``release(thread_id)`` releases the thread's session.

Reuse sessions: every run is a reuse session (:mod:`kvbaton.scope`), the same one in both modes — its
thread's (``thread_id``), else its own — so its requests place only spans the same run (or thread)
computed, and a new run's first agent reads its documents densely instead of inheriting an earlier,
unrelated run's K/V. ``wrap(app, session="name")`` is the explicit choice of reuse across runs: every
run of the wrapped app is that session.

Invariants: the wrapper changes no input, output or stream of the app; the step graph learns edges
at run time under the wrapper's lock, which the hint sender reads it under.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import uuid
from collections.abc import AsyncIterator, Collection, Iterator, Mapping
from contextvars import copy_context
from dataclasses import dataclass, field
from typing import Any

from kvbaton.ops import MAX_AGENT_CHARS, check_reuse
from kvbaton.scope import Scope, check_session
from kvbaton.stepgraph import StepGraph
from langchain_core.runnables import Runnable

from ..core import HintSender, sync_client
from ..ownership import (
    MAX_RETAINED_HANDLES,
    Threads,
    aend_run,
    check_limit,
    end_run,
    referenced_ids,
    release_oldest,
    release_superseded,
    run_scope,
)
from .chat_model import ACTIVE_RUN
from .graph import extract_step_graph
from .models import FoundModel, find_chat_models
from .openai_dropin import arelease_sessions, control_client, release_sessions, route
from .openai_dropin import install as install_openai_dropin
from .run import Run, reset_active

log = logging.getLogger("kvbaton.adapters.langgraph")

DEFAULT_REUSE = "auto"
"""The reuse policy a wrapped app's requests carry (mode 2): the same default as ``KvbatonChatModel``'s."""


@dataclass
class _Batch:
    """What the runs of one ``batch``/``abatch`` leave, superseded once at its end."""

    refs: dict[Any, set[str]] = field(default_factory=dict)  # per thread: what its results reference
    sessions: set[str] = field(default_factory=set)  # mode 2: the sessions of its runs without a thread_id


class LangGraphApp(Runnable):
    """A compiled LangGraph graph under kvbaton: same calls, inputs, outputs and stream modes (it
    delegates to the app); attributes it does not define come from the app. It is a LangChain
    ``Runnable``, so it goes wherever the graph went — a node of another graph, a ``|`` pipe,
    ``with_config``, ``astream_events`` — and every path runs through the wrapper."""

    def __init__(self, app: Any, client: Any = None, *, base_url: str | None = None, token: str | None = None,
                 redirect_openai: bool = False, narrow_wildcards: bool = True, release_handles: bool = True,
                 reuse: str | None = DEFAULT_REUSE, max_retained_handles: int | None = MAX_RETAINED_HANDLES,
                 session: str | None = None) -> None:
        check_reuse(reuse)
        self.session = check_session(session)  # None: each run (thread) is its own reuse session
        self.app = app
        self.reuse = reuse
        self.release_handles = release_handles
        self.max_retained_handles = check_limit(max_retained_handles)
        self._threads = Threads("langgraph")  # per thread_id: what its latest result references
        self._sessions: set[str] = set()  # mode 2: the server sessions of the latest runs without a thread_id
        self._sessions_lock = threading.Lock()
        control = sync_client(client)
        if client is not None and control is None:
            raise TypeError("wrap() needs a kvbaton Client (or an AsyncEmbeddedClient) for its control calls")
        self.token = token or os.environ.get("KVBATON_TOKEN") or None
        self.redirect_openai = redirect_openai
        self.models: list[FoundModel] = find_chat_models(app)
        """The chat models found on the app's nodes, and where each goes."""
        self.base_url = route(self.models, base_url, redirect_openai, self.token)
        if self.base_url:
            install_openai_dropin()
            if control is None:
                control = control_client(self.base_url, self.token)
        self.narrow_wildcards = narrow_wildcards
        extracted = extract_step_graph(app)
        self.extracted = extracted
        self.step_graph: StepGraph = extracted.step_graph
        self.subgraphs = extracted.subgraphs
        self.learned: dict[str, list[str]] = {}
        self._lock = threading.RLock()
        # the graph learns edges at run time: hints read it under the same lock
        self.hint_sender = HintSender(self.step_graph, control, lock=self._lock, logger=log)
        self.join_sources = {p for a in self.step_graph.agents for t in self.step_graph.triggers(a)
                             if len(t) > 1 for p in t}
        """Nodes some join waits for (a run tracks which have finished)."""

    @property
    def client(self) -> Any:
        """The client that receives hints and agent registrations (None until one is known)."""
        return self.hint_sender.client

    @client.setter
    def client(self, client: Any) -> None:
        self.hint_sender.client = client

    def __getattr__(self, name: str) -> Any:
        if name == "app":  # not set yet (unpickling, a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.app, name)

    # Runnable's descriptive members describe the app, not this wrapper
    def get_name(self, suffix: str | None = None, *, name: str | None = None) -> str:
        return self.app.get_name(suffix, name=name)

    @property
    def InputType(self) -> Any:  # noqa: N802 - Runnable's name
        return self.app.InputType

    @property
    def OutputType(self) -> Any:  # noqa: N802
        return self.app.OutputType

    @property
    def input_schema(self) -> Any:
        return self.app.input_schema

    @property
    def output_schema(self) -> Any:
        return self.app.output_schema

    @property
    def config_specs(self) -> Any:
        return self.app.config_specs

    def get_input_schema(self, config: Any = None) -> Any:
        return self.app.get_input_schema(config)

    def get_output_schema(self, config: Any = None) -> Any:
        return self.app.get_output_schema(config)

    def get_input_jsonschema(self, config: Any = None) -> dict[str, Any]:
        return self.app.get_input_jsonschema(config)

    def get_output_jsonschema(self, config: Any = None) -> dict[str, Any]:
        return self.app.get_output_jsonschema(config)

    def config_schema(self, *, include: Any = None) -> Any:
        return self.app.config_schema(include=include)

    def get_config_jsonschema(self, *, include: Any = None) -> dict[str, Any]:
        return self.app.get_config_jsonschema(include=include)

    def get_graph(self, config: Any = None, **kwargs: Any) -> Any:
        return self.app.get_graph(config, **kwargs)

    def with_config(self, config: Any = None, **kwargs: Any) -> LangGraphApp:
        """The app with an updated config, still wrapped: the copy shares this wrapper's step graph,
        learned routes, client and per-thread handles."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.app = self.app.with_config(config, **kwargs)
        return copy

    def astream_events(self, input: Any, config: Any = None, *, version: str = "v2", **kwargs: Any) -> Any:
        """Runnable's event stream (``v1``/``v2``) over this wrapper's ``astream``: hints and handles
        as in any run. ``v3`` (LangGraph's experimental run stream) is refused: its pump runs outside
        the wrapper's run."""
        if version == "v3":
            raise NotImplementedError("astream_events(version='v3') is not supported on a wrapped app: use 'v2'")
        return super().astream_events(input, config, version=version, **kwargs)  # type: ignore[arg-type]

    def stream_events(self, input: Any, config: Any = None, *, version: str = "v2", **kwargs: Any) -> Any:
        if version == "v3":
            raise NotImplementedError("stream_events(version='v3') is not supported on a wrapped app: use "
                                      "astream_events(version='v2')")
        return super().stream_events(input, config, version=version, **kwargs)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"kvbaton.adapters.langgraph.wrap({self.app!r}) with {self.step_graph!r}"

    # -- learning -------------------------------------------------------------------------------

    def learn(self, prev: dict[str, None], node: str) -> list[str]:
        """Record the hop that started ``node`` when the declared graph does not explain it; returns
        the wildcard routers it was learned from (narrowed once their step's hops are all seen)."""
        graph = self.step_graph
        with self._lock:
            routers = graph.routers
            wild = {src for src, targets in routers.items() if targets is None}
            for trigger in graph.triggers(node):
                if len(trigger) == 1 and next(iter(trigger)) in wild:
                    continue
                if any(p in prev for p in trigger):
                    return []
            sources = [p for p in prev if p in wild] or list(prev)
            for src in sources:
                learned = self.learned.setdefault(src, [])
                if node not in learned:
                    learned.append(node)
                graph.learn_edge(src, node)
            return [src for src in sources if src in wild]

    def routed(self, node: str, started: Collection[str]) -> bool:
        """Whether ``node``, which finished in the previous step, has made its choice now that ``started``
        run in this one: it is a router, one of its targets (any node, for a wildcard) started, and so
        did its plain successors. Its completion is then used up: the targets it did not pick are as far
        as its next run makes them (a supervisor's unpicked workers: 2 steps, through the supervisor),
        not one step away. The AutoGen adapter consumes a completion by the same rule."""
        graph = self.step_graph
        with self._lock:
            routers = graph.routers
            if node not in routers:
                return False
            targets = routers[node]
            if not any(targets is None or s in targets for s in started):
                return False
            return all(s in started for s in graph.successors(node))

    def narrow(self, src: str) -> None:
        """Replace wildcard router ``src`` by the targets observed so far (``narrow_wildcards``)."""
        with self._lock:
            if self.narrow_wildcards and self.step_graph.routers.get(src, ()) is None and self.learned.get(src):
                self.step_graph.set_router_targets(src, self.learned[src])

    # -- ownership ------------------------------------------------------------------------------
    @staticmethod
    def _thread(config: Any) -> Any:
        configurable = config.get("configurable") if isinstance(config, Mapping) else None
        return configurable.get("thread_id") if isinstance(configurable, Mapping) else None

    def _checkpointed(self, config: Any) -> bool:
        return bool(getattr(self.app, "checkpointer", None)) and self._thread(config) is not None

    def _begin(self, config: Any) -> tuple[Scope, Run]:
        """A run's scope and run time. The scope is its reuse session (the wrapper's, else the thread's or its
        own: ``Run.session``, which mode 2 sends as ``X-Kvbaton-Session``) and, with ``release_handles``, the
        owner of what it creates."""
        active = Run(self, config)
        if self.session is not None:
            active.session = self.session
        elif not active.session:  # an empty thread id names no session
            active.session = uuid.uuid4().hex
        elif len(active.session) > MAX_AGENT_CHARS:  # a long thread id: a session name of bounded length
            active.session = hashlib.sha256(active.session.encode()).hexdigest()
        run = run_scope("langgraph run") if self.release_handles else Scope(name="langgraph run (not owning)")
        run.session = active.session
        return run, active

    def _finish(self, run: Scope, config: Any, output: Any, session: str,
                deferred: _Batch | None = None) -> None:
        """End a run: what its result (with a checkpointer: its thread's latest checkpoint)
        references goes to the thread, the rest is released. In a batch the thread's earlier
        handles are superseded once, by every result of the batch (``deferred``)."""
        if not self.release_handles:
            return
        refs = referenced_ids(output)
        if self._checkpointed(config):
            try:
                refs |= referenced_ids(self.app.get_state(config).values)
            except Exception as exc:  # noqa: BLE001 - e.g. an async-only checkpointer: the output counts
                log.debug("kvbaton: no checkpoint state for %r: %s", self._thread(config), exc)
        stale = self._settle(run, config, refs, session, deferred)
        end_run(run, self._threads.owner(self._thread(config)), refs, supersede=deferred is None,
                limit=self.max_retained_handles)
        release_sessions(self.base_url, self.token, stale)

    async def _afinish(self, run: Scope, config: Any, output: Any, session: str,
                       deferred: _Batch | None = None) -> None:
        if not self.release_handles:
            return
        refs = referenced_ids(output)
        if self._checkpointed(config):
            try:
                refs |= referenced_ids((await self.app.aget_state(config)).values)
            except Exception as exc:  # noqa: BLE001
                log.debug("kvbaton: no checkpoint state for %r: %s", self._thread(config), exc)
        stale = self._settle(run, config, refs, session, deferred)
        await aend_run(run, self._threads.owner(self._thread(config)), refs, supersede=deferred is None,
                       limit=self.max_retained_handles)
        await arelease_sessions(self.base_url, self.token, stale)

    def _settle(self, run: Scope, config: Any, refs: set[str], session: str, deferred: _Batch | None) -> set[str]:
        """Name the run's scope and note what a batch supersedes at its end; the mode-2 sessions to
        release now: those of earlier runs without a ``thread_id`` that this one supersedes."""
        thread = self._thread(config)
        run.name = f"langgraph run of thread {thread!r}"
        if deferred is not None:
            deferred.refs.setdefault(thread, set()).update(refs)
        if not self.base_url or thread is not None or self.session is not None:
            return set()  # a thread's (or the wrapper's) session lives until release(thread_id)
        if deferred is not None:
            deferred.sessions.add(session)
            return set()
        return self._hold_sessions({session})

    def _hold_sessions(self, sessions: set[str]) -> set[str]:
        """Hold ``sessions`` as the latest runs' without a ``thread_id``; the ones they supersede."""
        with self._sessions_lock:
            stale, self._sessions = self._sessions - sessions, set(sessions)
        return stale

    def _supersede(self, deferred: _Batch) -> None:
        for thread, refs in deferred.refs.items():
            owner = self._threads.owner(thread)
            release_superseded(owner, refs)
            release_oldest(owner, self.max_retained_handles)
        if self.base_url and deferred.sessions:
            release_sessions(self.base_url, self.token, self._hold_sessions(deferred.sessions))

    def retained(self, thread_id: Any = None) -> list[str]:
        """The ids of the handles held for ``thread_id`` (None: runs without one): those the
        thread's latest result or checkpoint references."""
        return self._threads.retained(thread_id)

    def release(self, thread_id: Any = None) -> int:
        """Release the handles held for ``thread_id`` (a thread that is done), in mode 2 those the server
        retains in the thread's session too; returns how many."""
        return self._threads.release(thread_id) + release_sessions(self.base_url, self.token,
                                                                   self._thread_sessions(thread_id))

    async def arelease(self, thread_id: Any = None) -> int:
        return await self._threads.arelease(thread_id) + await arelease_sessions(
            self.base_url, self.token, self._thread_sessions(thread_id))

    def _thread_sessions(self, thread_id: Any) -> set[str]:
        """The mode-2 sessions of a thread that is done (those of the runs without one, for None)."""
        if not self.base_url:
            return set()
        if thread_id is not None:
            return {str(thread_id)}
        return self._hold_sessions(set()) | ({self.session} if self.session is not None else set())

    # -- delegation -----------------------------------------------------------------------------
    def _context(self, run: Scope, active: Run) -> Any:
        ctx = copy_context()
        ctx.run(ACTIVE_RUN.set, active)
        ctx.run(run.activate)  # the context is the run's own: nothing to reset
        return ctx

    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        return self._invoke(input, config, None, **kwargs)

    def _invoke(self, input: Any, config: Any, deferred: _Batch | None, **kwargs: Any) -> Any:
        run, active = self._begin(config)
        output = None
        try:
            output = self._context(run, active).run(self.app.invoke, input, config, **kwargs)
            return output
        finally:
            self._finish(run, config, output, active.session, deferred)

    def stream(self, input: Any, config: Any = None, **kwargs: Any) -> Iterator[Any]:
        run, active = self._begin(config)
        ctx = self._context(run, active)
        seen: set[str] = set()  # what the streamed states / updates referenced
        try:
            iterator = ctx.run(self.app.stream, input, config, **kwargs)
            done = object()
            try:
                while (item := ctx.run(next, iterator, done)) is not done:
                    if self.release_handles:
                        seen |= referenced_ids(item)
                    yield item
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    ctx.run(close)
        finally:
            self._finish(run, config, seen, active.session)

    def batch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False,
              **kwargs: Any) -> list[Any]:
        """Like the app's ``batch``; each input is its own run (its own steps, hints and scope)."""
        from langchain_core.runnables.config import get_config_list, get_executor_for_config

        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))
        deferred = _Batch()

        def one(item: Any, cfg: Any) -> Any:
            try:
                return self._invoke(item, cfg, deferred, **kwargs)
            except Exception as exc:
                if return_exceptions:
                    return exc
                raise

        try:
            with get_executor_for_config(configs[0]) as executor:
                return list(executor.map(one, inputs, configs))
        finally:
            self._supersede(deferred)

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        return await self._ainvoke(input, config, None, **kwargs)

    async def _ainvoke(self, input: Any, config: Any, deferred: _Batch | None, **kwargs: Any) -> Any:
        run, active = self._begin(config)
        token = ACTIVE_RUN.set(active)
        scoped = run.activate()
        output = None
        try:
            output = await self.app.ainvoke(input, config, **kwargs)
            return output
        finally:
            reset_active(token)
            Scope.deactivate(scoped)
            await self._afinish(run, config, output, active.session, deferred)

    async def astream(self, input: Any, config: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        run, active = self._begin(config)
        token = ACTIVE_RUN.set(active)
        scoped = run.activate()
        seen: set[str] = set()
        try:
            async for item in self.app.astream(input, config, **kwargs):
                if self.release_handles:
                    seen |= referenced_ids(item)
                yield item
        finally:
            reset_active(token)
            Scope.deactivate(scoped)
            await self._afinish(run, config, seen, active.session)

    async def abatch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False,
                     **kwargs: Any) -> list[Any]:
        """Like the app's ``abatch``; each input is its own run (its own steps, hints and scope)."""
        import asyncio

        from langchain_core.runnables.config import get_config_list

        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))
        limit = configs[0].get("max_concurrency")
        gate = asyncio.Semaphore(limit) if limit else None
        deferred = _Batch()

        async def one(item: Any, cfg: Any) -> Any:
            if gate is None:
                return await self._ainvoke(item, cfg, deferred, **kwargs)
            async with gate:
                return await self._ainvoke(item, cfg, deferred, **kwargs)

        try:
            return list(await asyncio.gather(*(one(i, c) for i, c in zip(inputs, configs)),
                                             return_exceptions=return_exceptions))
        finally:
            self._supersede(deferred)


def wrap(app: Any, client: Any = None, *, base_url: str | None = None, token: str | None = None,
         redirect_openai: bool = False, narrow_wildcards: bool = True, release_handles: bool = True,
         reuse: str | None = DEFAULT_REUSE, max_retained_handles: int | None = MAX_RETAINED_HANDLES,
         session: str | None = None) -> LangGraphApp:
    """Wrap a compiled LangGraph graph: the result is a Runnable that behaves like it.

    Every chat model found on the app's nodes is routed through kvbaton, or ``wrap`` raises
    :class:`~kvbaton.errors.InvalidRequest` saying what is missing (never a silent no-op):

    - ``KvbatonChatModel`` runs on kvbaton already (mode 1);
    - an OpenAI-SDK model (``ChatOpenAI``) goes to a ``kvbaton serve`` server (mode 2): ``base_url``,
      else ``$KVBATON_URL``, else the base URL the model itself was built with, checked to be a
      kvbaton server. A model left on ``api.openai.com`` is sent there only with
      ``redirect_openai=True`` (opt-in). Inside the wrapper's runs its requests carry
      ``X-Kvbaton-Agent: <node>`` and ``X-Kvbaton-Session: <thread_id>`` (a per-invocation id without
      one); their ``Authorization`` is ``token`` (default ``$KVBATON_TOKEN``) — the app's OpenAI key is
      never sent to the server. The returned handle id lands on the AIMessage, and hints/registrations
      go to the server unless ``client`` is given. ``reuse`` (mode 2 only; ``KvbatonChatModel`` has
      its own) is sent as ``X-Kvbaton-Reuse``: wrapping is the opt-in, so by default the requests
      carry the adapter's policy, ``"auto"`` (as ``KvbatonChatModel``'s default), and an answer
      served approximately says so on its AIMessage; ``"exact"`` keeps greedy output identical to
      dense prefill; None: the server's ``--reuse`` decides;
    - any other chat model is refused (at ``wrap``, or when it starts if it is built at run time).

    ``client`` (a kvbaton Client; an AsyncEmbeddedClient's sync client is used) receives the STE
    hints and agent registrations; without one, the client of the first :class:`KvbatonChatModel`
    that runs is adopted.

    ``narrow_wildcards``: once a step's hops are seen, replace a wildcard router's targets by the
    hops observed so far (else they are only added as edges and the wildcard stays).

    ``release_handles``: each call is an ownership scope (see the module docstring; ``False``:
    nothing is released, the handles are the caller's). ``max_retained_handles``: the most handles
    held per thread between runs (default 16; the oldest are released first; None: no bound).

    ``session``: the reuse session of every run (reuse across runs, on purpose). By default each run is its
    own session (its ``thread_id``'s, else one per invocation), in both modes: ``reuse="auto"`` places only
    spans the same run computed, so a new run's first agent never answers from an earlier run's K/V."""
    return LangGraphApp(app, client, base_url=base_url, token=token, redirect_openai=redirect_openai,
                        narrow_wildcards=narrow_wildcards, release_handles=release_handles, reuse=reuse,
                        max_retained_handles=max_retained_handles, session=session)


__all__ = ["DEFAULT_REUSE", "LangGraphApp", "wrap"]
