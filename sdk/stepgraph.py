"""Agent Step Graph: which agents of a workflow will run soon (steps-to-execution, STE).

A KV cache that knows the workflow keeps the prompts of agents about to run and evicts those of
agents far away (KVFlow, arXiv 2507.07400). This module only computes STE; it knows nothing of
engines or tensors.

Model: each agent has *triggers*. A trigger is a non-empty set of predecessor agents that must ALL
have completed (a join: max aggregation); an agent runs when ANY of its triggers is satisfied (a
branch: min aggregation). A plain edge ``a -> b`` is the one-agent trigger ``{a}``.

STE of a running agent is 0. For any other agent ``v``::

    value(T) = 1 + max(STE(p) for p in T if p not finished)     (1 when every p in T is finished)
    STE(v)   = min(value(T) for T in triggers(v))               (inf with no satisfiable trigger)

See docs/stepgraph.md.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import InvalidRequest

Ste = int | float  # an int, or math.inf for agents that cannot run in this round


class StepGraphSpec(BaseModel):
    """The wire form of a :class:`StepGraph` (JSON-serializable; send it to a server).

    ``triggers[v]`` lists v's triggers, each a list of predecessors that must all complete.
    ``routers[src]`` is src's router targets, or ``None`` for a wildcard (may route anywhere).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    agents: tuple[str, ...]
    entry_points: tuple[str, ...] = ()
    triggers: dict[str, tuple[tuple[str, ...], ...]] = Field(default_factory=dict)
    routers: dict[str, tuple[str, ...] | None] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> StepGraphSpec:
        # The spec is a wire format: unlike the builder, it never adds agents implicitly.
        known = set(self.agents)
        if len(known) != len(self.agents):
            raise ValueError("agents must be unique")
        if any(not name for name in self.agents):
            raise ValueError("agent names must be non-empty")
        referenced: list[str] = [*self.entry_points, *self.triggers, *self.routers]
        for triggers in self.triggers.values():
            for trigger in triggers:
                if not trigger:
                    raise ValueError("a trigger needs at least one predecessor")
                referenced.extend(trigger)
        for targets in self.routers.values():
            referenced.extend(targets or ())
        unknown = sorted(set(referenced) - known)
        if unknown:
            raise ValueError(f"unknown agents referenced: {unknown}")
        return self


class StepGraph:
    """A mutable Agent Step Graph. Agents named by any edge are added automatically."""

    def __init__(self) -> None:
        # dicts as insertion-ordered sets: deterministic output, specs and reprs
        self._agents: dict[str, None] = {}
        self._entries: dict[str, None] = {}
        self._triggers: dict[str, dict[frozenset[str], None]] = {}
        self._routers: dict[str, tuple[str, ...] | None] = {}

    # -- building -------------------------------------------------------------------------------

    def add_agent(self, name: str) -> None:
        """Add an agent (no-op when it exists)."""
        _check_name(name)
        if name not in self._agents:
            self._agents[name] = None
            self._triggers[name] = {}

    def add_entry(self, name: str) -> None:
        """Mark an agent as a possible start of the workflow (see :meth:`steps_to_execution`)."""
        self.add_agent(name)
        self._entries[name] = None

    def add_edge(self, src: str, dst: str) -> None:
        """``dst`` may run once ``src`` completes. Several edges into ``dst`` mean any one of them."""
        self.add_join([src], dst)

    def add_join(self, srcs: Iterable[str], dst: str) -> None:
        """``dst`` may run once ALL of ``srcs`` have completed (one trigger)."""
        trigger = frozenset(_names(srcs))
        if not trigger:
            raise InvalidRequest("a join needs at least one predecessor")
        for name in (*sorted(trigger), dst):
            self.add_agent(name)
        self._triggers[dst][trigger] = None

    def add_router(self, src: str, targets: Iterable[str] | None = None) -> None:
        """A conditional router out of ``src``: after ``src``, ONE of ``targets`` runs.

        ``targets=None`` means they are unknown until run time (a wildcard): ``src`` is then treated
        as an edge to every agent of the graph, including agents added later. That is conservative
        for caching: no agent is assumed unreachable from ``src``.
        """
        self.add_agent(src)
        if targets is None:
            self._routers[src] = None
            return
        known = tuple(dict.fromkeys(_names(targets)))
        for name in known:
            self.add_agent(name)
        self._routers[src] = known

    def set_router_targets(self, src: str, targets: Iterable[str]) -> None:
        """Replace the targets of ``src``'s router (typically a wildcard, once they are known)."""
        self.add_router(src, list(_names(targets)))

    def learn_edge(self, src: str, dst: str) -> None:
        """Record a hop ``src -> dst`` observed at run time (adds ``dst`` if new)."""
        # A plain edge rather than a router target: an observed hop stays possible even if the
        # router's declared targets are replaced later.
        self.add_edge(src, dst)

    # -- reading --------------------------------------------------------------------------------

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(self._agents)

    @property
    def entry_points(self) -> tuple[str, ...]:
        return tuple(self._entries)

    @property
    def routers(self) -> dict[str, tuple[str, ...] | None]:
        """Router targets per source; ``None`` marks a wildcard."""
        return dict(self._routers)

    def triggers(self, agent: str) -> tuple[frozenset[str], ...]:
        """The triggers of ``agent`` that STE uses: its edges and joins plus router hops into it."""
        self._check_known([agent])
        found = dict(self._triggers[agent])
        for src, targets in self._routers.items():
            if targets is None or agent in targets:
                found[frozenset((src,))] = None
        return tuple(found)

    def successors(self, agent: str) -> tuple[str, ...]:
        """The agents with an edge or a join out of ``agent`` (router targets not included): those its
        completion enables without a choice."""
        self._check_known([agent])
        return tuple(dst for dst, triggers in self._triggers.items() if any(agent in t for t in triggers))

    # -- steps to execution ---------------------------------------------------------------------

    def steps_to_execution(self, running: Iterable[str] = (), finished: Iterable[str] = ()) -> dict[str, Ste]:
        """STE of every agent, given the agents running now and those finished in this round.

        Running agents have STE 0. A finished agent counts as already completed for every trigger
        that names it (it adds no wait), while its own STE is computed like any other agent's (a
        cycle may run it again). When both ``running`` and ``finished`` are empty the workflow has
        not started: the entry points are taken as running. Agents that cannot run in this round
        get ``math.inf``. A single string is accepted as one agent name.
        """
        run = set(_names(running))
        done = set(_names(finished))
        self._check_known(run | done)
        if not run and not done:
            run = set(self._entries)
        # Knuth's generalisation of Dijkstra's algorithm: a trigger's value (1 + the max of its predecessors'
        # STEs) is never below any of them, so agents settle in increasing STE order, each once, and a trigger
        # is ready when its last unfinished predecessor settles (then its largest). O(size log size), where a
        # fixpoint iteration takes a round per hop (quadratic on a deep chain). An agent that never settles has
        # no derivation from running or finished agents (a cycle nothing reaches): it stays infinite.
        ste: dict[str, Ste] = {agent: math.inf for agent in self._agents}
        order = itertools.count()
        heap: list[tuple[Ste, int, str]] = [(0, next(order), agent) for agent in self._agents if agent in run]
        unsettled: list[int] = []  # per trigger: its unfinished predecessors not settled yet
        waiting: dict[str, list[tuple[int, str]]] = {agent: [] for agent in self._agents}  # agent -> (trigger, dst)
        for agent in self._agents:
            if agent in run:
                continue
            for trigger in self.triggers(agent):
                pending = [p for p in trigger if p not in done]
                if not pending:  # every predecessor finished: ready in one step
                    heapq.heappush(heap, (1, next(order), agent))
                    continue
                for p in pending:
                    waiting[p].append((len(unsettled), agent))
                unsettled.append(len(pending))
        while heap:
            value, _, agent = heapq.heappop(heap)
            if ste[agent] <= value:
                continue  # settled already, at most this
            ste[agent] = value
            for trigger, dst in waiting[agent]:
                unsettled[trigger] -= 1
                if unsettled[trigger] == 0 and ste[dst] == math.inf:
                    heapq.heappush(heap, (value + 1, next(order), dst))
        return ste

    # -- serialization --------------------------------------------------------------------------

    def to_spec(self) -> StepGraphSpec:
        return StepGraphSpec(
            agents=self.agents,
            entry_points=self.entry_points,
            triggers={
                agent: tuple(tuple(sorted(trigger)) for trigger in triggers)
                for agent, triggers in self._triggers.items()
                if triggers
            },
            routers=self.routers,
        )

    @classmethod
    def from_spec(cls, spec: StepGraphSpec) -> StepGraph:
        graph = cls()
        for agent in spec.agents:
            graph.add_agent(agent)
        for agent in spec.entry_points:
            graph.add_entry(agent)
        for agent, triggers in spec.triggers.items():
            for trigger in triggers:
                graph.add_join(trigger, agent)
        for src, targets in spec.routers.items():
            graph.add_router(src, targets)
        return graph

    def __repr__(self) -> str:
        n_triggers = sum(len(t) for t in self._triggers.values())
        routers = {src: "*" if targets is None else list(targets) for src, targets in self._routers.items()}
        return (
            f"StepGraph(agents={list(self._agents)}, triggers={n_triggers}, "
            f"entry_points={list(self._entries)}, routers={routers})"
        )

    def _check_known(self, names: Iterable[str]) -> None:
        unknown = sorted({name for name in names if name not in self._agents})  # O(names), not O(agents)
        if unknown:
            raise InvalidRequest(f"unknown agents: {unknown}")


def _names(names: Iterable[str]) -> tuple[str, ...]:
    # A bare string is one name, not an iterable of one-letter names.
    items = (names,) if isinstance(names, str) else tuple(names)
    for name in items:
        _check_name(name)
    return items


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"agent names must be non-empty strings, got {name!r}")
