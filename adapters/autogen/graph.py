"""The Agent Step Graph of an AutoGen (autogen-agentchat 0.7) team, read from the team's type.

GraphFlow: its ``DiGraph`` (joins, conditional routers, cycles); RoundRobinGroupChat: a cycle in
participant order; SelectorGroupChat: a complete graph of wildcard routers (chosen at run time);
Swarm: a router per agent over its handoff targets and itself; a single agent: a one-agent loop.
Invariant: extraction only reads the team; it changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autogen_agentchat.base import ChatAgent
from kvbaton.stepgraph import StepGraph


def participants_of(team: Any) -> list[ChatAgent]:
    """A team's participants (none for a single agent)."""
    return list(getattr(team, "_participants", None) or getattr(team, "_input_participants", None) or [])


def graph_from_digraph(digraph: Any) -> StepGraph:
    """A GraphFlow ``DiGraph`` as a step graph.

    Edges into a node are grouped by ``activation_group``: an ``"all"`` group is one join trigger
    (max), each edge of an ``"any"`` group is its own trigger (min). Conditional edges (a string or
    callable condition) out of one source become a router over their targets (one of them runs),
    unless they are part of a multi-source ``"all"`` join. Cycles are kept as they are."""
    graph = StepGraph()
    for name in digraph.nodes:
        graph.add_agent(name)
    for name in sorted(digraph.get_start_nodes()):
        graph.add_entry(name)
    groups: dict[tuple[str, str], tuple[str, list[tuple[str, Any]]]] = {}
    for src, node in digraph.nodes.items():
        for edge in node.edges:
            key = (edge.target, edge.activation_group or edge.target)
            condition, edges = groups.setdefault(key, (edge.activation_condition, []))
            edges.append((src, edge))
    routed: dict[str, list[str]] = {}
    for (target, _group), (condition, edges) in groups.items():
        if condition == "all" and len(edges) > 1:
            graph.add_join([src for src, _ in edges], target)
            continue
        for src, edge in edges:
            if edge.condition is not None or edge.condition_function is not None:
                routed.setdefault(src, []).append(target)
            else:
                graph.add_edge(src, target)
    for src, targets in routed.items():
        graph.add_router(src, targets)
    return graph


def graph_round_robin(names: Sequence[str]) -> StepGraph:
    """RoundRobinGroupChat: a cycle in participant order, starting at the first participant."""
    graph = StepGraph()
    for name in names:
        graph.add_agent(name)
    if names:
        graph.add_entry(names[0])
        for i, name in enumerate(names):
            graph.add_edge(name, names[(i + 1) % len(names)])
    return graph


def graph_selector(names: Sequence[str]) -> StepGraph:
    """SelectorGroupChat: a complete graph whose hops are chosen at run time (wildcard routers);
    any participant may speak first."""
    graph = StepGraph()
    for name in names:
        graph.add_entry(name)
    for name in names:
        graph.add_router(name, None)
    return graph


def _handoff_targets(agent: Any) -> list[str] | None:
    handoffs = getattr(agent, "_handoffs", None)
    if handoffs is None:
        handoffs = getattr(agent, "kvbaton_handoffs", None)
    if handoffs is None:
        return None
    items = handoffs.values() if isinstance(handoffs, dict) else handoffs
    return [h if isinstance(h, str) else h.target for h in items]


def graph_swarm(participants: Sequence[Any]) -> StepGraph:
    """Swarm: the first participant starts; each agent hands off to one of its handoff targets or keeps
    the turn (a router over its targets and itself). An agent whose handoffs are unknown (not an
    AssistantAgent and no ``kvbaton_handoffs`` attribute) gets a wildcard router."""
    graph = StepGraph()
    names = [p.name for p in participants]
    for name in names:
        graph.add_agent(name)
    if names:
        graph.add_entry(names[0])
    for agent in participants:
        targets = _handoff_targets(agent)
        if targets is None:
            graph.add_router(agent.name, None)
        else:
            graph.add_router(agent.name, [*[t for t in targets if t in names], agent.name])
    return graph


def extract_step_graph(team: Any) -> StepGraph:
    """The step graph of a team (or a one-agent graph for a single agent)."""
    from autogen_agentchat.teams import GraphFlow, RoundRobinGroupChat, SelectorGroupChat, Swarm

    participants = participants_of(team)
    names = [p.name for p in participants]
    if isinstance(team, GraphFlow):
        return graph_from_digraph(team._graph)
    if isinstance(team, RoundRobinGroupChat):
        return graph_round_robin(names)
    if isinstance(team, SelectorGroupChat):
        return graph_selector(names)
    if isinstance(team, Swarm):
        return graph_swarm(participants)
    if participants:  # another group chat: assume anyone may follow anyone
        return graph_selector(names)
    graph = StepGraph()
    graph.add_entry(team.name)
    graph.add_router(team.name, [team.name])
    return graph
