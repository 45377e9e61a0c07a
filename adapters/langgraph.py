"""LangGraph adapter: put kvbaton under an existing LangGraph app in one line.

    from kvbaton.adapters.langgraph import KvbatonChatModel, wrap
    app = wrap(graph.compile(), client)          # behaves like the compiled graph
    app.step_graph                               # the Agent Step Graph read from app.builder
    app.invoke({...})                            # sends STE hints before each step

- :func:`extract_step_graph` reads the graph from ``app.builder`` (static edges, joins, conditional
  branches, Command destinations, deferred nodes, subgraphs), not from ``get_graph()``.
- At run time a callback registered with ``register_configure_hook`` (active only inside the
  wrapper's calls) sees node starts and ends, sends ``client.hints(step_graph, running, finished)``
  before each step, learns wildcard routes from observed hops, and registers each agent's fixed
  prompt once per client.
- :class:`KvbatonChatModel` is the chat model (handles on messages; see ``_langchain_model``).

What is not LangGraph-specific — the hint sender, agent registration, the tool-call convention, the
best handle, sync/async dispatch — is :mod:`kvbaton.adapters.core`, shared with the AutoGen adapter.

See docs/langgraph.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextvars import copy_context
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from kvbaton.stepgraph import StepGraph
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables import RunnableLambda, RunnableSequence
from langchain_core.runnables.utils import get_function_nonlocals
from langchain_core.tracers.context import register_configure_hook

from ._langchain_model import ACTIVE_RUN, KVBATON_KEY, KvbatonChatModel, agent_from_metadata, handle_of, to_chat
from ._openai_dropin import CURRENT_CALL, CallTag, control_client, normalize_base_url
from ._openai_dropin import install as install_openai_dropin
from .core import HintSender, register_fixed_prompt, sync_client

log = logging.getLogger("kvbaton.adapters.langgraph")

START = "__start__"
END = "__end__"

# The run state of a wrapped call is also its callback handler: LangChain adds it to every
# callback manager configured while ACTIVE_RUN is set (inheritable, so nested runs see it too).
register_configure_hook(ACTIVE_RUN, inheritable=True)


# -- graph extraction -------------------------------------------------------------------------------


@dataclass
class ExtractedGraph:
    """What :func:`extract_step_graph` read from a LangGraph app."""

    step_graph: StepGraph
    subgraphs: dict[str, ExtractedGraph] = field(default_factory=dict)
    """Inner graph per outer node whose runnable is a compiled graph (calls inside count for the outer node)."""
    deferred: set[str] = field(default_factory=set)
    """Nodes with ``defer=True`` (run when the rest of the step's work is done)."""
    wildcards: set[str] = field(default_factory=set)
    """Routers whose targets were unknown at build time (learned at run time)."""


def _find_subgraph(runnable: Any) -> Any:
    """A compiled graph inside a node's runnable (directly, in a sequence, or captured by the node's
    function), like langgraph's own ``find_subgraph_pregel`` but also with checkpointer=False."""
    from langgraph._internal._runnable import RunnableCallable
    from langgraph.pregel import Pregel

    candidates, seen = [runnable], set()
    for c in candidates:
        if id(c) in seen:
            continue
        seen.add(id(c))
        if isinstance(c, Pregel):
            return c
        if isinstance(c, RunnableSequence):
            candidates.extend(c.steps)
        elif isinstance(c, RunnableLambda):
            candidates.extend(c.deps)
        elif isinstance(c, RunnableCallable):
            fn = c.func if c.func is not None else c.afunc
            if fn is not None:
                try:
                    candidates.extend(getattr(n, "__self__", n) for n in get_function_nonlocals(fn))
                except Exception:  # noqa: BLE001 - source unavailable: no subgraph found
                    log.debug("kvbaton: cannot inspect %r for subgraphs", fn)
    return None


def _merge(routers: dict[str, list[str] | None], src: str, targets: Sequence[str] | None) -> None:
    if targets is None or (src in routers and routers[src] is None):
        routers[src] = None
        return
    known = routers.setdefault(src, [])
    assert known is not None
    known.extend(t for t in targets if t not in known)


def extract_step_graph(app: Any) -> ExtractedGraph:
    """The Agent Step Graph of a compiled LangGraph graph (or a ``StateGraph`` builder).

    - ``builder.edges``: plain edges; ``START -> x`` makes ``x`` an entry point; edges to END are dropped;
    - ``builder.waiting_edges``: joins (wait for all -> max);
    - ``builder.branches[src][name].ends``: router targets (one of them -> min); ``None`` (no path
      map, e.g. a function returning ``Send``s) is a wildcard router, narrowed at run time;
      a conditional entry (branch out of START) makes its targets (or every node) entry points;
    - ``builder.nodes[n].ends``: Command destinations, added to ``n``'s router targets;
    - error handler nodes: a router target of the node they handle;
    - nodes with no declared successor at all (may return an unannotated ``Command``): wildcard;
    - deferred nodes keep their edges (their extra wait is not modelled) and are listed in ``deferred``;
    - subgraphs are extracted recursively into ``subgraphs[outer node]``; their calls are the outer
      node's agent. (``Command(graph=Command.PARENT)`` hops cannot be declared in LangGraph: they
      are learned at run time like any undeclared hop.)
    """
    builder = getattr(app, "builder", app)
    if not hasattr(builder, "nodes") or not hasattr(builder, "edges"):
        return _from_drawable(app)
    graph = StepGraph()
    result = ExtractedGraph(graph)
    nodes = builder.nodes
    routers: dict[str, list[str] | None] = {}
    has_out: set[str] = set()
    for name in nodes:
        graph.add_agent(name)
    for src, dst in sorted(builder.edges):
        if src == START:
            if dst != END:
                graph.add_entry(dst)
            continue
        has_out.add(src)
        if dst != END:
            graph.add_edge(src, dst)
    for starts, dst in sorted(getattr(builder, "waiting_edges", ())):
        srcs = [s for s in starts if s != START]
        has_out.update(srcs)
        if dst == END:
            continue
        if srcs:
            graph.add_join(srcs, dst)
        else:
            graph.add_entry(dst)
    for src, branches in getattr(builder, "branches", {}).items():
        for spec in branches.values():
            ends = getattr(spec, "ends", None)
            targets = None if ends is None else [t for t in ends.values() if t != END]
            if src == START:
                for t in targets if targets is not None else list(nodes):
                    graph.add_entry(t)
                continue
            has_out.add(src)
            _merge(routers, src, targets)
    for name, spec in nodes.items():
        ends = getattr(spec, "ends", None) or ()
        if ends:
            has_out.add(name)
            _merge(routers, name, [t for t in ends if t != END and t in nodes])
        if getattr(spec, "defer", False):
            result.deferred.add(name)
        handler = getattr(spec, "error_handler_node", None)
        if handler:
            _merge(routers, name, [handler])
        sub = _find_subgraph(getattr(spec, "runnable", None))
        if sub is not None and sub is not app:
            inner = extract_step_graph(sub)
            result.subgraphs[name] = inner
    for name, spec in nodes.items():
        if name not in has_out and not getattr(spec, "is_error_handler", False):
            routers[name] = None
    for src, targets in routers.items():
        graph.add_router(src, targets)
        if targets is None:
            result.wildcards.add(src)
    return result


def _from_drawable(app: Any) -> ExtractedGraph:
    """Fallback for graphs without a builder (e.g. the functional API): ``get_graph()``."""
    graph = StepGraph()
    result = ExtractedGraph(graph)
    drawn = app.get_graph()
    for node_id in drawn.nodes:
        if node_id not in (START, END):
            graph.add_agent(node_id)
    routers: dict[str, list[str] | None] = {}
    for e in drawn.edges:
        if e.target == END:
            continue
        if e.source == START:
            graph.add_entry(e.target)
        elif e.conditional:
            _merge(routers, e.source, [e.target])
        else:
            graph.add_edge(e.source, e.target)
    for src, targets in routers.items():
        graph.add_router(src, targets)
    return result


# -- run time ---------------------------------------------------------------------------------------


class _Run(BaseCallbackHandler):
    """One wrapped invocation: follows its top-level node starts and ends, sends hints."""

    run_inline = True
    raise_error = False
    ignore_retriever = True

    def __init__(self, wrapper: LangGraphApp) -> None:
        self.wrapper = wrapper
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
        if not metadata or not tags or "langgraph_node" not in metadata:
            return
        ns = metadata.get("langgraph_checkpoint_ns", "")
        if not any(t.startswith("graph:step:") for t in tags) or "|" in ns:
            return  # not a node task of the wrapped (top-level) graph
        node = metadata["langgraph_node"]
        step = metadata.get("langgraph_step")
        if node not in self.wrapper.step_graph.agents:
            return
        self.node_runs[run_id] = node
        self._node_start(node, step if isinstance(step, int) else -1)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        node = self.node_runs.pop(run_id, None)
        if node is not None:
            self._node_end(node)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.node_runs.pop(run_id, None)

    def on_chat_model_start(self, serialized: Any, messages: list[list[Any]], *, run_id: UUID,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # KvbatonChatModel registers its own (exact) prompt; other chat models (ChatOpenAI on a
        # kvbaton server) are registered here with the wrapper's client.
        params = kwargs.get("invocation_params") or {}
        if params.get("_type") == "kvbaton" or not messages:
            return
        agent = agent_from_metadata(metadata)
        if self.wrapper.base_url:  # mode 2: the patched httpx send tags this call's requests
            tag = CallTag(agent)
            CURRENT_CALL.set(tag)
            self.openai_calls[run_id] = tag
        if self.wrapper.client is not None:
            register_fixed_prompt(self.wrapper.client, agent, to_chat(messages[0]))  # never raises

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        tag = self.openai_calls.pop(run_id, None)
        if tag is None:
            return
        CURRENT_CALL.set(None)
        for generations in getattr(response, "generations", ()):
            for generation in generations:
                message = getattr(generation, "message", None)
                if message is not None and tag.handle:
                    message.additional_kwargs[KVBATON_KEY] = {"handle": {"id": tag.handle}, "agent": tag.agent or ""}

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

    def _node_end(self, node: str) -> None:
        with self.lock:
            if node in self.wrapper._join_sources:
                self.pending_join[node] = None

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


class LangGraphApp:
    """A compiled LangGraph graph under kvbaton: same calls, inputs, outputs and stream modes (it
    delegates to the app); attributes it does not define come from the app."""

    def __init__(self, app: Any, client: Any = None, *, base_url: str | None = None, token: str | None = None,
                 redirect_openai: bool = True, narrow_wildcards: bool = True) -> None:
        self.app = app
        control = sync_client(client)
        if client is not None and control is None:
            raise TypeError("wrap() needs a kvbaton Client (or an AsyncEmbeddedClient) for its control calls")
        self.base_url = normalize_base_url(base_url) if base_url else None
        self.token = token
        self.redirect_openai = redirect_openai
        if self.base_url:
            install_openai_dropin()
            if control is None:
                control = control_client(self.base_url, token)
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
        return getattr(self.app, name)

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

    # -- delegation -----------------------------------------------------------------------------
    def _context(self) -> Any:
        ctx = copy_context()
        ctx.run(ACTIVE_RUN.set, _Run(self))
        return ctx

    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        return self._context().run(self.app.invoke, input, config, **kwargs)

    def stream(self, input: Any, config: Any = None, **kwargs: Any) -> Iterator[Any]:
        ctx = self._context()
        iterator = ctx.run(self.app.stream, input, config, **kwargs)
        done = object()
        try:
            while (item := ctx.run(next, iterator, done)) is not done:
                yield item
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                ctx.run(close)

    def batch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False,
              **kwargs: Any) -> list[Any]:
        """Like the app's ``batch``; each input is its own run (its own steps and hints)."""
        from langchain_core.runnables.config import get_config_list, get_executor_for_config

        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))

        def one(item: Any, cfg: Any) -> Any:
            try:
                return self.invoke(item, cfg, **kwargs)
            except Exception as exc:
                if return_exceptions:
                    return exc
                raise

        with get_executor_for_config(configs[0]) as executor:
            return list(executor.map(one, inputs, configs))

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        token = ACTIVE_RUN.set(_Run(self))
        try:
            return await self.app.ainvoke(input, config, **kwargs)
        finally:
            _reset(token)

    async def astream(self, input: Any, config: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        token = ACTIVE_RUN.set(_Run(self))
        try:
            async for item in self.app.astream(input, config, **kwargs):
                yield item
        finally:
            _reset(token)

    async def abatch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False,
                     **kwargs: Any) -> list[Any]:
        """Like the app's ``abatch``; each input is its own run (its own steps and hints)."""
        import asyncio

        from langchain_core.runnables.config import get_config_list

        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))
        limit = configs[0].get("max_concurrency")
        gate = asyncio.Semaphore(limit) if limit else None

        async def one(item: Any, cfg: Any) -> Any:
            if gate is None:
                return await self.ainvoke(item, cfg, **kwargs)
            async with gate:
                return await self.ainvoke(item, cfg, **kwargs)

        return list(await asyncio.gather(*(one(i, c) for i, c in zip(inputs, configs)),
                                         return_exceptions=return_exceptions))


def _reset(token: Any) -> None:
    try:
        ACTIVE_RUN.reset(token)
    except ValueError:  # an async generator closed from another context
        ACTIVE_RUN.set(None)


def wrap(app: Any, client: Any = None, *, base_url: str | None = None, token: str | None = None,
         redirect_openai: bool = True, narrow_wildcards: bool = True) -> LangGraphApp:
    """Wrap a compiled LangGraph graph.

    ``client`` (a kvbaton Client; an AsyncEmbeddedClient's sync client is used) receives the STE
    hints and agent registrations; without one, the client of the first :class:`KvbatonChatModel`
    that runs is adopted.

    ``base_url`` (a ``kvbaton serve`` URL) turns on mode 2 for apps whose nodes call ``ChatOpenAI``
    (or any OpenAI-SDK client): inside the wrapper's runs their requests to ``base_url`` carry
    ``X-Kvbaton-Agent: <node>``, requests to ``api.openai.com`` are redirected there
    (``redirect_openai``; ``token`` replaces their API key), the returned handle id lands on the
    AIMessage, and hints/registrations go to the server unless ``client`` is given.

    ``narrow_wildcards``: once a step's hops are seen, replace a wildcard router's targets by the
    hops observed so far (else they are only added as edges and the wildcard stays)."""
    return LangGraphApp(app, client, base_url=base_url, token=token, redirect_openai=redirect_openai,
                        narrow_wildcards=narrow_wildcards)


__all__ = [
    "KVBATON_KEY",
    "ExtractedGraph",
    "KvbatonChatModel",
    "LangGraphApp",
    "agent_from_metadata",
    "extract_step_graph",
    "handle_of",
    "wrap",
]
