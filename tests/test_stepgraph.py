"""The Agent Step Graph: steps-to-execution (STE) of each agent of a workflow.

Examples first (they read as the specification), then property tests against an independent
forward simulation of the workflow.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbaton.errors import InvalidRequest
from kvbaton.stepgraph import StepGraph, StepGraphSpec
from pydantic import ValidationError

pytestmark = pytest.mark.unit

inf = math.inf


def chain(*agents: str) -> StepGraph:
    graph = StepGraph()
    for src, dst in zip(agents, agents[1:]):
        graph.add_edge(src, dst)
    return graph


# -- examples -------------------------------------------------------------------------------------


def test_chain_counts_hops_and_nothing_runs_backwards():
    graph = chain("a", "b", "c", "d")
    assert graph.steps_to_execution(running=["a"]) == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert graph.steps_to_execution(running=["c"]) == {"a": inf, "b": inf, "c": 0, "d": 1}


def fan(join: bool) -> StepGraph:
    # split fans out to a short and a long branch that meet again at merge
    graph = StepGraph()
    graph.add_edge("split", "fast")
    graph.add_edge("split", "slow1")
    graph.add_edge("slow1", "slow2")
    if join:
        graph.add_join(["fast", "slow2"], "merge")
    else:
        graph.add_edge("fast", "merge")
        graph.add_edge("slow2", "merge")
    return graph


def test_join_waits_for_the_slowest_branch():
    ste = fan(join=True).steps_to_execution(running=["split"])
    assert ste == {"split": 0, "fast": 1, "slow1": 1, "slow2": 2, "merge": 3}


def test_plain_edges_into_an_agent_mean_any_one_of_them():
    ste = fan(join=False).steps_to_execution(running=["split"])
    assert ste == {"split": 0, "fast": 1, "slow1": 1, "slow2": 2, "merge": 2}


def test_finished_agents_satisfy_joins():
    graph = fan(join=True)
    # fast is done, slow2 is running: merge only waits for slow2
    assert graph.steps_to_execution(running=["slow2"], finished=["fast"])["merge"] == 1
    # fast neither done nor reachable (split is not running): the join can never fire
    assert graph.steps_to_execution(running=["slow2"])["merge"] == inf
    # every predecessor done: merge is next
    assert graph.steps_to_execution(finished=["fast", "slow2"])["merge"] == 1


def test_running_wins_over_finished():
    graph = chain("a", "b")
    assert graph.steps_to_execution(running=["a"], finished=["a"]) == {"a": 0, "b": 1}


def peer() -> StepGraph:
    # PEER-style loop: plan, execute two tools in parallel, express, review; the reviewer either
    # sends the work back to the planner or on to the summarizer.
    graph = StepGraph()
    graph.add_entry("planner")
    graph.add_edge("planner", "search")
    graph.add_edge("planner", "code")
    graph.add_join(["search", "code"], "expresser")
    graph.add_edge("expresser", "reviewer")
    graph.add_router("reviewer", ["planner", "summarizer"])
    return graph


def test_cycle_with_a_branch():
    graph = peer()
    assert graph.steps_to_execution(running=["reviewer"]) == {
        "planner": 1, "search": 2, "code": 2, "expresser": 3, "reviewer": 0, "summarizer": 1,
    }
    # just after the expresser the planner is 2 steps away, although it ran least recently
    assert graph.steps_to_execution(running=["expresser"]) == {
        "planner": 2, "search": 3, "code": 3, "expresser": 0, "reviewer": 1, "summarizer": 2,
    }


def test_cycle_through_an_unfinished_join_stays_infinite():
    graph = peer()
    # code is done: the join only waits for search
    assert graph.steps_to_execution(running=["search"], finished=["code"]) == {
        "planner": 3, "search": 0, "code": 4, "expresser": 1, "reviewer": 2, "summarizer": 3,
    }
    # code neither runs nor finished: it could only run after the join that waits for it
    assert graph.steps_to_execution(running=["search"]) == {
        "planner": inf, "search": 0, "code": inf, "expresser": inf, "reviewer": inf, "summarizer": inf,
    }


def test_self_loop():
    graph = StepGraph()
    graph.add_edge("react", "react")  # a ReAct agent calls itself until it answers
    graph.add_edge("react", "answer")
    assert graph.steps_to_execution(running=["react"]) == {"react": 0, "answer": 1}
    # nothing reaches the loop: it does not justify itself
    assert graph.steps_to_execution(running=["answer"]) == {"react": inf, "answer": 0}
    assert graph.steps_to_execution(finished=["react"]) == {"react": 1, "answer": 1}


def test_self_join_needs_itself_finished():
    graph = StepGraph()
    graph.add_join(["x", "y"], "x")
    assert graph.steps_to_execution(running=["y"])["x"] == inf
    assert graph.steps_to_execution(running=["y"], finished=["x"])["x"] == 1


def test_entry_points_run_first_only_before_the_workflow_starts():
    graph = StepGraph()
    graph.add_entry("a")
    graph.add_entry("b")
    graph.add_edge("a", "c")
    graph.add_edge("b", "c")
    assert graph.steps_to_execution() == {"a": 0, "b": 0, "c": 1}
    # once something runs or finished, entry points are ordinary agents
    assert graph.steps_to_execution(running=["a"]) == {"a": 0, "b": inf, "c": 1}
    assert graph.steps_to_execution(finished=["a"]) == {"a": inf, "b": inf, "c": 1}


def test_no_entry_points_and_nothing_running_means_nothing_runs():
    assert chain("a", "b").steps_to_execution() == {"a": inf, "b": inf}


def test_wildcard_router_may_reach_every_agent():
    graph = StepGraph()
    graph.add_router("planner")  # targets decided at run time
    graph.add_edge("coder", "reviewer")
    graph.add_edge("writer", "reviewer")
    graph.add_edge("reviewer", "planner")
    assert graph.routers == {"planner": None}
    assert graph.steps_to_execution(running=["planner"]) == {"planner": 0, "coder": 1, "reviewer": 1, "writer": 1}
    assert graph.steps_to_execution(running=["reviewer"]) == {"planner": 1, "coder": 2, "reviewer": 0, "writer": 2}

    # an agent seen later is covered by the wildcard too
    graph.learn_edge("planner", "critic")
    assert graph.steps_to_execution(running=["reviewer"])["critic"] == 2

    # once the targets are known, agents outside them are no longer reachable from the planner
    graph.set_router_targets("planner", ["coder"])
    assert graph.routers == {"planner": ("coder",)}
    assert graph.steps_to_execution(running=["reviewer"]) == {
        "planner": 1, "coder": 2, "reviewer": 0, "writer": inf, "critic": 2,  # learned edges stay
    }


def test_triggers_include_router_hops():
    graph = StepGraph()
    graph.add_join(["a", "b"], "c")
    graph.add_router("a", ["c"])
    assert set(graph.triggers("c")) == {frozenset({"a", "b"}), frozenset({"a"})}


def test_agents_are_added_by_edges_in_order():
    graph = StepGraph()
    graph.add_edge("b", "a")
    graph.add_agent("z")
    graph.add_join(["y", "x"], "a")
    assert graph.agents == ("b", "a", "z", "x", "y")
    assert "StepGraph(agents=['b', 'a', 'z', 'x', 'y'], triggers=2" in repr(graph)


def test_a_single_string_is_one_agent():
    graph = chain("planner", "executor")
    assert graph.steps_to_execution("planner") == {"planner": 0, "executor": 1}


def test_misuse_raises_invalid_request():
    graph = chain("a", "b")
    with pytest.raises(InvalidRequest, match="unknown agents: \\['nope'\\]"):
        graph.steps_to_execution(running=["nope"])
    with pytest.raises(InvalidRequest, match="unknown"):
        graph.steps_to_execution(running=["a"], finished=["ghost"])
    with pytest.raises(InvalidRequest):
        graph.add_join([], "a")
    with pytest.raises(InvalidRequest):
        graph.add_edge("", "a")
    with pytest.raises(InvalidRequest):
        graph.add_agent(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        graph.triggers("nope")


def test_spec_json_round_trip():
    graph = peer()
    graph.add_router("summarizer")
    graph.add_edge("summarizer", "summarizer")
    wire = graph.to_spec().model_dump_json()
    again = StepGraph.from_spec(StepGraphSpec.model_validate_json(wire))
    assert again.to_spec() == graph.to_spec()
    assert again.agents == graph.agents and again.entry_points == graph.entry_points
    for running in (["reviewer"], ["summarizer"], []):
        assert again.steps_to_execution(running) == graph.steps_to_execution(running)


def test_spec_rejects_dangling_names():
    with pytest.raises(ValidationError, match="unknown agents"):
        StepGraphSpec(agents=("a",), triggers={"a": (("b",),)})
    with pytest.raises(ValidationError, match="unknown agents"):
        StepGraphSpec(agents=("a",), routers={"a": ("b",)})
    with pytest.raises(ValidationError, match="at least one"):
        StepGraphSpec(agents=("a",), triggers={"a": ((),)})
    with pytest.raises(ValidationError):
        StepGraphSpec.model_validate({"agents": ["a"], "extra": 1})


@pytest.mark.parametrize("built", ["forward", "backward"])
def test_a_chain_of_twenty_thousand_agents(built):
    """Deep workflows cost time linear in their size whatever order the graph was built in (no recursion, no
    round per hop)."""
    names = [f"a{i}" for i in range(20_000)]
    graph = StepGraph()
    edges = list(zip(names, names[1:]))
    for src, dst in edges if built == "forward" else reversed(edges):
        graph.add_edge(src, dst)
    ste = graph.steps_to_execution(running=["a0"])
    assert ste["a19999"] == 19_999 and ste["a1"] == 1
    assert graph.steps_to_execution(running=["a10000"])["a0"] == inf


# -- properties against a forward simulation ------------------------------------------------------

NAMES = "abcdefg"


@st.composite
def workflows(draw: st.DrawFn) -> dict:
    """A small random workflow: triggers (with cycles and self-loops), routers, and a state."""
    n = draw(st.integers(1, len(NAMES)))
    agents = list(NAMES[:n])

    def subset(mask: int) -> set[str]:  # bit masks draw much faster than sets of names
        return {a for i, a in enumerate(agents) if mask >> i & 1}

    some = st.integers(0, 2**n - 1).map(subset)
    triggers = {a: [subset(m) for m in draw(st.lists(st.integers(1, 2**n - 1), max_size=3))] for a in agents}
    routers = draw(st.dictionaries(st.sampled_from(agents), st.none() | some.map(sorted), max_size=2))
    return {"agents": agents, "triggers": triggers, "routers": routers, "entries": draw(some),
            "running": draw(some), "finished": draw(some)}


def build(w: dict) -> StepGraph:
    graph = StepGraph()
    for agent in w["agents"]:
        graph.add_agent(agent)
    for agent in w["entries"]:
        graph.add_entry(agent)
    for agent, triggers in w["triggers"].items():
        for trigger in triggers:
            graph.add_join(sorted(trigger), agent)
    for src, targets in w["routers"].items():
        graph.add_router(src, targets)
    return graph


def simulate(w: dict, running: set[str], finished: set[str]) -> dict[str, float]:
    """Reference: fire agents forward in time and record when each first fires.

    At step 0 the running agents fire. At step t+1 an agent fires if one of its triggers is
    satisfied by step t: each predecessor has finished, or has fired at some step <= t. So a
    trigger of finished agents only fires at step 1. Agents never fired are infinitely far.
    """
    agents = w["agents"]
    triggers = {a: [set(t) for t in w["triggers"][a]] for a in agents}
    for src, targets in w["routers"].items():  # a router hop is an edge; a wildcard goes anywhere
        for dst in agents if targets is None else targets:
            triggers[dst].append({src})
    if not running and not finished:
        running = set(w["entries"])
    fired: dict[str, int] = {a: 0 for a in running}
    for t in range(len(agents) + 2):
        ready = set(fired) | finished  # snapshot of step t
        for agent in agents:
            if agent not in fired and any(trigger <= ready for trigger in triggers[agent]):
                fired[agent] = t + 1
    return {a: fired.get(a, inf) for a in agents}


PROPERTY = settings(max_examples=200, deadline=None)


@PROPERTY
@given(workflows())
def test_matches_forward_simulation(w):
    ste = build(w).steps_to_execution(w["running"], w["finished"])
    assert ste == simulate(w, w["running"], w["finished"])


@PROPERTY
@given(workflows())
def test_running_agents_are_exactly_the_zeros_and_finite_values_are_small(w):
    ste = build(w).steps_to_execution(w["running"], w["finished"])
    if w["running"]:
        assert {a for a, s in ste.items() if s == 0} == w["running"]
    assert all(s == inf or (isinstance(s, int) and 0 <= s <= len(w["agents"])) for s in ste.values())


@PROPERTY
@given(workflows(), st.data())
def test_more_running_or_finished_never_raises_ste(w, data):
    # (Holds once the workflow has started: before that, the entry points count as running.)
    graph = build(w)
    started = w["running"] | {w["agents"][0]}
    extra = data.draw(st.sampled_from(w["agents"]))
    before = graph.steps_to_execution(started, w["finished"])
    for after in (graph.steps_to_execution(started | {extra}, w["finished"]),
                  graph.steps_to_execution(started, w["finished"] | {extra})):
        assert all(after[a] <= before[a] for a in w["agents"])


@PROPERTY
@given(workflows(), st.data())
def test_wildcard_is_a_lower_bound_of_any_known_targets(w, data):
    # Conservative for caching: resolving a wildcard can only push agents further away.
    graph = build(w)
    src = data.draw(st.sampled_from(w["agents"]))
    graph.add_router(src)
    wildcard = graph.steps_to_execution(w["running"], w["finished"])
    graph.set_router_targets(src, data.draw(st.lists(st.sampled_from(w["agents"]))))
    known = graph.steps_to_execution(w["running"], w["finished"])
    assert all(wildcard[a] <= known[a] for a in w["agents"])


@PROPERTY
@given(workflows())
def test_spec_round_trip_keeps_ste(w):
    graph = build(w)
    again = StepGraph.from_spec(StepGraphSpec.model_validate_json(graph.to_spec().model_dump_json()))
    assert again.to_spec() == graph.to_spec()
    assert again.steps_to_execution(w["running"], w["finished"]) == graph.steps_to_execution(w["running"], w["finished"])
