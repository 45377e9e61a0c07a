"""LangGraph adapter: put kvbaton under an existing LangGraph app in one line.

    from kvbaton.adapters.langgraph import KvbatonChatModel, wrap
    app = wrap(graph.compile(), client)          # behaves like the compiled graph, and is a Runnable
    app.step_graph                               # the Agent Step Graph read from app.builder
    app.invoke({...})                            # sends STE hints before each step

- ``wrap`` finds the chat models the app's nodes use (``_langgraph_models``) and routes them
  through kvbaton — ``KvbatonChatModel`` runs on kvbaton; an OpenAI-SDK model (``ChatOpenAI``) goes
  to the kvbaton server named by ``base_url`` / ``$KVBATON_URL`` or by its own base URL (mode 2,
  ``_openai_dropin``) — or raises :class:`~kvbaton.errors.InvalidRequest` saying what is missing.

- :func:`extract_step_graph` reads the graph from ``app.builder`` (static edges, joins, conditional
  branches, Command destinations, deferred nodes, subgraphs), not from ``get_graph()``
  (``_langgraph_graph``).
- At run time a callback registered with ``register_configure_hook`` (active only inside the
  wrapper's calls) sees node starts and ends, sends ``client.hints(step_graph, running, finished)``
  before each step, learns wildcard routes from observed hops, and registers each agent's fixed
  prompt once per client.
- :class:`KvbatonChatModel` is the chat model (handles on messages; see ``_langchain_model``).
- Each call (``invoke``/``stream``/``batch`` and their async twins) is an ownership scope
  (:mod:`kvbaton.scope`): the handles created during the run are released when it ends, except
  those its result references — with a checkpointer, its thread's latest checkpoint. Those are
  held per ``thread_id`` until the thread's next run supersedes them (released unless referenced
  again) or ``app.release(thread_id)``; ``client.keep(handle)`` keeps one past every scope.

What is not LangGraph-specific — the hint sender, agent registration, the tool-call convention, the
best handle, sync/async dispatch — is :mod:`kvbaton.adapters.core`, shared with the AutoGen adapter.

See docs/langgraph.md.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextvars import copy_context
from typing import Any
from uuid import UUID

from kvbaton.errors import InvalidRequest
from kvbaton.ops import check_reuse
from kvbaton.scope import Scope
from kvbaton.stepgraph import StepGraph
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables import Runnable
from langchain_core.tracers.context import register_configure_hook

from ._langgraph_graph import END, START, ExtractedGraph, extract_step_graph  # noqa: F401 - END, START: this module's names too
from ._langchain_model import (
    ACTIVE_RUN,
    KVBATON_KEY,
    ChatKvbaton,
    KvbatonChatModel,
    agent_from_metadata,
    handle_of,
    to_chat,
)
from ._langgraph_models import OPENAI_BASE, FoundModel, find_chat_models
from ._openai_dropin import CURRENT_CALL, CallTag, control_client, normalize_base_url
from ._openai_dropin import install as install_openai_dropin
from .core import HintSender, register_fixed_prompt, sync_client
from .ownership import Threads, aend_run, end_run, referenced_ids, release_superseded, run_scope

log = logging.getLogger("kvbaton.adapters.langgraph")

# The run state of a wrapped call is also its callback handler: LangChain adds it to every
# callback manager configured while ACTIVE_RUN is set (inheritable, so nested runs see it too).
register_configure_hook(ACTIVE_RUN, inheritable=True)


# -- run time ---------------------------------------------------------------------------------------


class _Run(BaseCallbackHandler):
    """One wrapped invocation: follows its top-level node starts and ends, sends hints."""

    run_inline = True
    raise_error = True  # only on_chat_model_start raises: a chat model kvbaton cannot route (never silent)
    ignore_retriever = True

    def __init__(self, wrapper: LangGraphApp, config: Any = None) -> None:
        self.wrapper = wrapper
        configurable = config.get("configurable") if isinstance(config, Mapping) else None
        configurable = configurable if isinstance(configurable, Mapping) else {}
        # the namespace the wrapped graph runs in: "" at the top, "outer:task" as a node of another graph
        ns = configurable.get("checkpoint_ns")
        self.base_ns: str = ns if isinstance(ns, str) else ""
        thread = configurable.get("thread_id")
        # mode 2: the server keeps each session's retained handles apart (X-Kvbaton-Session)
        self.session: str = str(thread) if thread is not None else uuid.uuid4().hex
        self.lock = threading.RLock()
        self.step: int | None = None
        self.current: dict[str, None] = {}  # nodes started in the current step
        self.prev: dict[str, None] = {}  # nodes of the previous step
        self.pending_join: dict[str, None] = {}  # finished join sources whose join has not fired yet
        self.node_runs: dict[UUID, str] = {}
        self.openai_calls: dict[UUID, CallTag] = {}
        self.to_narrow: set[str] = set()  # wildcard routers with hops learned in the current step
        self.last_hint: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self.unsent: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    # client discovery: a run without a client sends its hints to the first KvbatonChatModel's
    def bind_client(self, client: Any) -> None:
        control = sync_client(client)
        if control is None or self.wrapper.client is not None:
            return
        with self.lock:
            if self.wrapper.client is None:
                self.wrapper.client = control
            unsent, self.unsent = self.unsent, None
        if unsent is not None:
            self._send(*unsent)

    # -- callbacks --------------------------------------------------------------------------------
    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       tags: list[str] | None = None, metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        try:
            self._chain_start(run_id, tags, metadata)
        except Exception:  # noqa: BLE001 - hints are advisory: they never break the app
            log.exception("kvbaton: following a node start failed")

    def _chain_start(self, run_id: UUID, tags: list[str] | None, metadata: dict[str, Any] | None) -> None:
        if not metadata or not tags or "langgraph_node" not in metadata:
            return
        ns = metadata.get("langgraph_checkpoint_ns", "")
        if not any(t.startswith("graph:step:") for t in tags) or not self.own(ns):
            return  # not a node task of the wrapped graph (a subgraph's, or an enclosing graph's)
        node = metadata["langgraph_node"]
        step = metadata.get("langgraph_step")
        if node not in self.wrapper.step_graph.agents:
            return
        self.node_runs[run_id] = node
        self._node_start(node, step if isinstance(step, int) else -1)

    def own(self, ns: str) -> bool:
        """Whether checkpoint namespace ``ns`` is a node task of the wrapped graph itself."""
        if not self.base_ns:
            return "|" not in ns
        return ns.startswith(self.base_ns + "|") and "|" not in ns[len(self.base_ns) + 1:]

    def agent(self, metadata: Mapping[str, Any] | None) -> str | None:
        """The wrapped graph's node a call belongs to (see :func:`agent_from_metadata`)."""
        return agent_from_metadata(metadata, self.base_ns)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        node = self.node_runs.pop(run_id, None)
        if node is not None:
            with self.lock:
                if node in self.wrapper._join_sources:
                    self.pending_join[node] = None

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.node_runs.pop(run_id, None)

    def on_chat_model_start(self, serialized: Any, messages: list[list[Any]], *, run_id: UUID,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # KvbatonChatModel registers its own (exact) prompt; other chat models (ChatOpenAI on a
        # kvbaton server) are registered here with the wrapper's client.
        if ACTIVE_RUN.get() is not self:
            return  # the call of a nested wrapped graph: its own run handles it
        params = kwargs.get("invocation_params") or {}
        if params.get("_type") == "kvbaton" or not messages:
            return
        agent = self.agent(metadata)
        if not self.wrapper.base_url:
            ids = serialized.get("id") if isinstance(serialized, Mapping) else None
            name = ids[-1] if isinstance(ids, list) and ids else "a chat model"
            raise InvalidRequest(
                f"node {agent!r} called {name}, which this wrap() cannot route through kvbaton: use KvbatonChatModel, "
                "or give wrap() base_url=<kvbaton serve URL> (or set KVBATON_URL) for an OpenAI-SDK model"
            )
        tag = CallTag(agent)  # mode 2: the patched httpx send tags this call's requests
        CURRENT_CALL.set(tag)
        self.openai_calls[run_id] = tag
        if self.wrapper.client is not None:
            register_fixed_prompt(self.wrapper.client, agent, to_chat(messages[0]))  # never raises

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        tag = self.openai_calls.pop(run_id, None)
        if tag is None:
            return
        CURRENT_CALL.set(None)
        if not tag.reached:
            log.warning("kvbaton: the chat model call of node %r did not reach the kvbaton server at %s",
                        tag.agent, self.wrapper.base_url)
        for generations in getattr(response, "generations", ()):
            for generation in generations:
                message = getattr(generation, "message", None)
                if message is not None and tag.handle:
                    message.additional_kwargs[KVBATON_KEY] = {"handle": {"id": tag.handle}, "agent": tag.agent or ""}
                if message is not None and tag.exact is not None:
                    message.response_metadata[KVBATON_KEY] = {"exact": tag.exact}

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        if self.openai_calls.pop(run_id, None) is not None:
            CURRENT_CALL.set(None)

    # -- steps ------------------------------------------------------------------------------------
    def _node_start(self, node: str, step: int) -> None:
        graph = self.wrapper.step_graph
        with self.lock:
            if step != self.step:
                # the hops out of the previous step are all known now: narrow its wildcards
                for src in self.to_narrow:
                    self.wrapper._narrow(src)
                self.to_narrow.clear()
                consecutive = self.step is not None and step == self.step + 1
                self.prev = self.current if consecutive else {}
                self.current = {}
                self.step = step
            self.current[node] = None
            if self.prev:
                self.to_narrow.update(self.wrapper._learn(self.prev, node))
            for trigger in graph.triggers(node):
                if len(trigger) > 1 and all(p in self.pending_join for p in trigger):
                    for p in trigger:
                        self.pending_join.pop(p, None)
            running = tuple(self.current)
            finished = tuple(n for n in {**self.prev, **self.pending_join} if n not in self.current)
        self._send(running, finished)

    def _send(self, running: tuple[str, ...], finished: tuple[str, ...]) -> None:
        with self.lock:
            if (running, finished) == self.last_hint:
                return
            if self.wrapper.client is None:
                self.unsent = (running, finished)
                return
            self.last_hint = (running, finished)
        self.wrapper.hint_sender.send(running, finished)


# -- the wrapper ------------------------------------------------------------------------------------


class LangGraphApp(Runnable):
    """A compiled LangGraph graph under kvbaton: same calls, inputs, outputs and stream modes (it
    delegates to the app); attributes it does not define come from the app. It is a LangChain
    ``Runnable``, so it goes wherever the graph went — a node of another graph, a ``|`` pipe,
    ``with_config``, ``astream_events`` — and every path runs through the wrapper."""

    def __init__(self, app: Any, client: Any = None, *, base_url: str | None = None, token: str | None = None,
                 redirect_openai: bool = False, narrow_wildcards: bool = True, release_handles: bool = True,
                 reuse: str | None = None) -> None:
        check_reuse(reuse)
        self.app = app
        self.reuse = reuse
        self.release_handles = release_handles
        self._threads = Threads("langgraph")  # per thread_id: what its latest result references
        control = sync_client(client)
        if client is not None and control is None:
            raise TypeError("wrap() needs a kvbaton Client (or an AsyncEmbeddedClient) for its control calls")
        self.token = token or os.environ.get("KVBATON_TOKEN") or None
        self.redirect_openai = redirect_openai
        self.models: list[FoundModel] = find_chat_models(app)
        """The chat models found on the app's nodes, and where each goes."""
        self.base_url = _route(self.models, base_url, redirect_openai, self.token)
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
        self._join_sources = {p for a in self.step_graph.agents for t in self.step_graph.triggers(a)
                              if len(t) > 1 for p in t}

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

    def _learn(self, prev: dict[str, None], node: str) -> list[str]:
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

    def _narrow(self, src: str) -> None:
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

    def _begin(self) -> Scope | None:
        return run_scope("langgraph run") if self.release_handles else None

    def _finish(self, run: Scope | None, config: Any, output: Any, deferred: dict[Any, set[str]] | None = None) -> None:
        """End a run: what its result (with a checkpointer: its thread's latest checkpoint)
        references goes to the thread, the rest is released. In a batch the thread's earlier
        handles are superseded once, by every result of the batch (``deferred``)."""
        if run is None:
            return
        refs = referenced_ids(output)
        if self._checkpointed(config):
            try:
                refs |= referenced_ids(self.app.get_state(config).values)
            except Exception as exc:  # noqa: BLE001 - e.g. an async-only checkpointer: the output counts
                log.debug("kvbaton: no checkpoint state for %r: %s", self._thread(config), exc)
        self._settle(run, config, refs, deferred)
        end_run(run, self._threads.owner(self._thread(config)), refs, supersede=deferred is None)

    async def _afinish(self, run: Scope | None, config: Any, output: Any,
                       deferred: dict[Any, set[str]] | None = None) -> None:
        if run is None:
            return
        refs = referenced_ids(output)
        if self._checkpointed(config):
            try:
                refs |= referenced_ids((await self.app.aget_state(config)).values)
            except Exception as exc:  # noqa: BLE001
                log.debug("kvbaton: no checkpoint state for %r: %s", self._thread(config), exc)
        self._settle(run, config, refs, deferred)
        await aend_run(run, self._threads.owner(self._thread(config)), refs, supersede=deferred is None)

    def _settle(self, run: Scope, config: Any, refs: set[str], deferred: dict[Any, set[str]] | None) -> None:
        run.name = f"langgraph run of thread {self._thread(config)!r}"
        if deferred is not None:
            deferred.setdefault(self._thread(config), set()).update(refs)

    def _supersede(self, deferred: dict[Any, set[str]]) -> None:
        for thread, refs in deferred.items():
            release_superseded(self._threads.owner(thread), refs)

    def retained(self, thread_id: Any = None) -> list[str]:
        """The ids of the handles held for ``thread_id`` (None: runs without one): those the
        thread's latest result or checkpoint references."""
        return self._threads.retained(thread_id)

    def release(self, thread_id: Any = None) -> int:
        """Release the handles held for ``thread_id`` (a thread that is done); returns how many."""
        return self._threads.release(thread_id)

    async def arelease(self, thread_id: Any = None) -> int:
        return await self._threads.arelease(thread_id)

    # -- delegation -----------------------------------------------------------------------------
    def _context(self, run: Scope | None, config: Any) -> Any:
        ctx = copy_context()
        ctx.run(ACTIVE_RUN.set, _Run(self, config))
        if run is not None:
            ctx.run(run.activate)  # the context is the run's own: nothing to reset
        return ctx

    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        return self._invoke(input, config, None, **kwargs)

    def _invoke(self, input: Any, config: Any, deferred: dict[Any, set[str]] | None, **kwargs: Any) -> Any:
        run = self._begin()
        output = None
        try:
            output = self._context(run, config).run(self.app.invoke, input, config, **kwargs)
            return output
        finally:
            self._finish(run, config, output, deferred)

    def stream(self, input: Any, config: Any = None, **kwargs: Any) -> Iterator[Any]:
        run = self._begin()
        ctx = self._context(run, config)
        seen: set[str] = set()  # what the streamed states / updates referenced
        try:
            iterator = ctx.run(self.app.stream, input, config, **kwargs)
            done = object()
            try:
                while (item := ctx.run(next, iterator, done)) is not done:
                    if run is not None:
                        seen |= referenced_ids(item)
                    yield item
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    ctx.run(close)
        finally:
            self._finish(run, config, seen)

    def batch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False,
              **kwargs: Any) -> list[Any]:
        """Like the app's ``batch``; each input is its own run (its own steps, hints and scope)."""
        from langchain_core.runnables.config import get_config_list, get_executor_for_config

        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))
        deferred: dict[Any, set[str]] = {}

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

    async def _ainvoke(self, input: Any, config: Any, deferred: dict[Any, set[str]] | None, **kwargs: Any) -> Any:
        run = self._begin()
        token = ACTIVE_RUN.set(_Run(self, config))
        scoped = run.activate() if run is not None else None
        output = None
        try:
            output = await self.app.ainvoke(input, config, **kwargs)
            return output
        finally:
            _reset(token)
            if scoped is not None:
                Scope.deactivate(scoped)
            await self._afinish(run, config, output, deferred)

    async def astream(self, input: Any, config: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        run = self._begin()
        token = ACTIVE_RUN.set(_Run(self, config))
        scoped = run.activate() if run is not None else None
        seen: set[str] = set()
        try:
            async for item in self.app.astream(input, config, **kwargs):
                if run is not None:
                    seen |= referenced_ids(item)
                yield item
        finally:
            _reset(token)
            if scoped is not None:
                Scope.deactivate(scoped)
            await self._afinish(run, config, seen)

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
        deferred: dict[Any, set[str]] = {}

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


def _reset(token: Any) -> None:
    try:
        ACTIVE_RUN.reset(token)
    except ValueError:  # an async generator closed from another context
        ACTIVE_RUN.set(None)


def _route(models: list[FoundModel], base_url: str | None, redirect_openai: bool, token: str | None) -> str | None:
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


def wrap(app: Any, client: Any = None, *, base_url: str | None = None, token: str | None = None,
         redirect_openai: bool = False, narrow_wildcards: bool = True, release_handles: bool = True,
         reuse: str | None = None) -> LangGraphApp:
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
      its own) sends ``X-Kvbaton-Reuse``; None: the server's ``--reuse`` decides;
    - any other chat model is refused (at ``wrap``, or when it starts if it is built at run time).

    ``client`` (a kvbaton Client; an AsyncEmbeddedClient's sync client is used) receives the STE
    hints and agent registrations; without one, the client of the first :class:`KvbatonChatModel`
    that runs is adopted.

    ``narrow_wildcards``: once a step's hops are seen, replace a wildcard router's targets by the
    hops observed so far (else they are only added as edges and the wildcard stays).

    ``release_handles``: each call is an ownership scope (see the module docstring; ``False``:
    nothing is released, the handles are the caller's)."""
    return LangGraphApp(app, client, base_url=base_url, token=token, redirect_openai=redirect_openai,
                        narrow_wildcards=narrow_wildcards, release_handles=release_handles, reuse=reuse)


__all__ = [
    "KVBATON_KEY",
    "ChatKvbaton",
    "ExtractedGraph",
    "FoundModel",
    "KvbatonChatModel",
    "LangGraphApp",
    "agent_from_metadata",
    "extract_step_graph",
    "find_chat_models",
    "handle_of",
    "wrap",
]
