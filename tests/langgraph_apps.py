"""LangGraph apps the adapter tests wrap, built the way an app's author writes them."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

from langgraph.graph import END, START, StateGraph


def chain(state: type, nodes: Mapping[str, Callable[..., Any]], *, end: bool = True) -> StateGraph:
    """``START -> nodes[0] -> nodes[1] -> ...``, then ``-> END`` (with ``end=False`` the caller routes
    the last node). Uncompiled: the caller compiles it (checkpointer, interrupts)."""
    graph = StateGraph(state)
    for name, node in nodes.items():
        graph.add_node(name, node)
    names = list(nodes)
    graph.add_edge(START, names[0])
    for a, b in itertools.pairwise(names):
        graph.add_edge(a, b)
    if end:
        graph.add_edge(names[-1], END)
    return graph
