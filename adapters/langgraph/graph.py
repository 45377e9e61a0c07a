"""Graph extraction of the LangGraph adapter: a compiled LangGraph app's Agent Step Graph, read
from ``app.builder`` (static edges, joins, conditional branches, Command destinations, deferred
nodes, subgraphs) rather than from ``get_graph()`` (which loses joins).

Invariant: extraction only reads the builder; what it cannot know at build time (routers without a
path map, nodes without declared successors) is a wildcard router, narrowed at run time by
:mod:`kvbaton.adapters.langgraph`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbaton.stepgraph import StepGraph
from langchain_core.runnables import RunnableLambda, RunnableSequence
from langchain_core.runnables.utils import get_function_nonlocals

log = logging.getLogger("kvbaton.adapters.langgraph")

START = "__start__"
END = "__end__"


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
      node's agent. A graph that runs one enclosing it (graphs calling each other) is not extracted again
      there. (``Command(graph=Command.PARENT)`` hops cannot be declared in LangGraph: they
      are learned at run time like any undeclared hop.)
    """
    return _extract(app, frozenset())


def _extract(app: Any, enclosing: frozenset[int]) -> ExtractedGraph:
    """:func:`extract_step_graph` inside the graphs whose ids are ``enclosing``."""
    enclosing |= {id(app)}
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
        if sub is not None and id(sub) not in enclosing:
            result.subgraphs[name] = _extract(sub, enclosing)
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


__all__ = ["END", "START", "ExtractedGraph", "extract_step_graph"]
