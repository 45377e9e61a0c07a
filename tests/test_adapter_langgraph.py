"""LangGraph adapter: graph extraction from the builder, run-time STE hints and learning, the chat
model (handles on messages, reuse, async, streaming, tools, structured output), checkpointers and
interrupts. Real LangGraph graphs; the real engine (SmolLM2-135M, greedy, max_tokens 4) where the
model matters, an instant fake client elsewhere."""

from __future__ import annotations

import asyncio
import inspect
import math
import operator
from typing import Annotated, Any, Literal, TypedDict

import pytest

pytest.importorskip("langgraph")

import kvbaton
from kvbaton.adapters.core import parse_tool_calls
from kvbaton.adapters.langgraph import (
    KVBATON_KEY,
    KvbatonChatModel,
    agent_from_metadata,
    extract_step_graph,
    handle_of,
    wrap,
)
from kvbaton.bench.adapter_overhead import InstantClient, build_graph
from kvbaton.embedded import AsyncEmbeddedClient, EmbeddedClient
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph, add_messages
from langgraph.types import Command, Send
from langgraph_apps import chain
from pydantic import BaseModel

INF = math.inf


class State(TypedDict):
    messages: Annotated[list, add_messages]
    rounds: int


class Plain(TypedDict):
    log: Annotated[list, operator.add]


def _noop(state: Any) -> dict[str, Any]:
    return {"log": ["x"]}


# -- extraction (no model) --------------------------------------------------------------------------


def test_extract_joins_branches_commands_subgraphs() -> None:
    inner = StateGraph(Plain)

    def inner_router(state: Plain) -> Command[Literal["polish"]]:
        return Command(goto="polish")

    inner.add_node("draft", inner_router)
    inner.add_node("polish", _noop)
    inner.add_edge(START, "draft")
    sub = inner.compile()

    def supervisor(state: Plain) -> Command[Literal["a", "b", "__end__"]]:
        return Command(goto="a")

    g = StateGraph(Plain)
    g.add_node("supervisor", supervisor)
    for n in ("a", "b", "c", "reviewer", "fan", "worker"):
        g.add_node(n, _noop)
    g.add_node("writer", sub)
    g.add_node("final", _noop, defer=True)
    g.add_edge(START, "supervisor")
    g.add_edge("a", "c")
    g.add_edge("b", "c")  # plain edges into c: any one (min)
    g.add_edge(["a", "b"], "reviewer")  # join: wait for all (max)
    g.add_conditional_edges("reviewer", lambda s: "w", {"w": "writer", "f": "fan", "x": END})
    g.add_conditional_edges("fan", lambda s: [Send("worker", s)])  # no path map: wildcard
    g.add_edge("worker", "final")
    g.add_edge("writer", "final")
    g.add_edge("final", END)
    g.add_edge("c", END)
    app = g.compile()

    ex = extract_step_graph(app)
    sg = ex.step_graph
    assert set(sg.agents) == {"supervisor", "a", "b", "c", "reviewer", "fan", "worker", "writer", "final"}
    assert sg.entry_points == ("supervisor",)
    declared = sg.to_spec().triggers  # edges and joins (router hops are listed apart)
    assert set(declared["reviewer"]) == {("a", "b")}
    assert set(declared["c"]) == {("a",), ("b",)}
    routers = sg.routers
    assert set(routers["supervisor"]) == {"a", "b"}  # Command destinations, END dropped
    assert set(routers["reviewer"]) == {"writer", "fan"}
    assert routers["fan"] is None and ex.wildcards == {"fan"}
    assert ex.deferred == {"final"}
    inner_ex = ex.subgraphs["writer"]
    assert inner_ex.step_graph.entry_points == ("draft",)
    assert inner_ex.step_graph.routers["draft"] == ("polish",)
    # joins are max, the plain edges into c are min
    ste = sg.steps_to_execution(running=["a"], finished=[])
    assert ste["c"] == 1 and ste["reviewer"] == INF  # b never runs unless supervisor routes there
    ste = sg.steps_to_execution(running=["a", "b"])
    assert ste["reviewer"] == 1 and ste["writer"] == 2 and ste["worker"] == 3 and ste["final"] == 3
    # get_graph() would have lost the join: it draws a -> reviewer and b -> reviewer as plain edges
    drawn = {(e.source, e.target) for e in app.get_graph().edges}
    assert ("a", "reviewer") in drawn and ("b", "reviewer") in drawn


def test_extract_conditional_entry_and_undeclared_successors() -> None:
    g = StateGraph(Plain)
    g.add_node("x", _noop)
    g.add_node("y", _noop)
    g.add_node("loose", _noop)  # no outgoing edge at all: may return an unannotated Command
    g.add_conditional_edges(START, lambda s: "x", ["x", "y"])
    g.add_edge("x", "loose")
    g.add_edge("y", END)
    ex = extract_step_graph(g.compile())
    assert set(ex.step_graph.entry_points) == {"x", "y"}
    assert ex.step_graph.routers == {"loose": None}
    # the builder itself works too
    assert set(extract_step_graph(g).step_graph.agents) == {"x", "y", "loose"}


@pytest.mark.unit
def test_graphs_that_run_each_other_are_extracted_once() -> None:
    # Each graph's node runs the other (agents delegating to each other): an enclosing graph is not a subgraph.
    def ask_b(state: Plain) -> dict[str, Any]:
        return app_b.invoke(state)

    def ask_a(state: Plain) -> dict[str, Any]:
        return app_a.invoke(state)

    ga, gb = StateGraph(Plain), StateGraph(Plain)
    ga.add_node("a", ask_b)
    ga.add_edge(START, "a")
    gb.add_node("b", ask_a)
    gb.add_edge(START, "b")
    app_a, app_b = ga.compile(), gb.compile()
    ex = extract_step_graph(app_a)
    assert ex.subgraphs["a"].step_graph.agents == ("b",) and ex.subgraphs["a"].subgraphs == {}


WORKERS = ("w1", "w2", "w3")
# A supervisor that picks each worker once, each worker reporting back to it; by hand, per turn:
# the supervisor runs: every worker is one step away; a worker runs: the supervisor is one step
# away and the workers it did not pick two (through the supervisor), never one.
SUPERVISOR_TURNS = ["supervisor", "w1", "supervisor", "w2", "supervisor", "w3", "supervisor"]
SUPERVISOR_STE = [
    {"supervisor": 0, "w1": 1, "w2": 1, "w3": 1},
    {"supervisor": 1, "w1": 0, "w2": 2, "w3": 2},
    {"supervisor": 0, "w1": 1, "w2": 1, "w3": 1},
    {"supervisor": 1, "w1": 2, "w2": 0, "w3": 2},
    {"supervisor": 0, "w1": 1, "w2": 1, "w3": 1},
    {"supervisor": 1, "w1": 2, "w2": 2, "w3": 0},
    {"supervisor": 0, "w1": 1, "w2": 1, "w3": 1},
]


@pytest.mark.unit
def test_supervisor_steps_to_execution_match_the_hand_computed_values_in_both_adapters() -> None:
    pytest.importorskip("autogen_agentchat")
    from autogen_agentchat.teams import DiGraph, DiGraphEdge, DiGraphNode
    from kvbaton.adapters.autogen import Instrumentation, graph_from_digraph

    def supervisor(state: Plain) -> dict[str, Any]:
        return {"log": ["supervisor"]}

    def pick(state: Plain) -> str:
        return next((w for w in WORKERS if w not in state["log"]), END)

    g = StateGraph(Plain)
    g.add_node("supervisor", supervisor)
    for w in WORKERS:
        g.add_node(w, lambda state, w=w: {"log": [w]})
        g.add_edge(w, "supervisor")
    g.add_edge(START, "supervisor")
    g.add_conditional_edges("supervisor", pick, [*WORKERS, END])
    client = InstantClient()
    wrap(g.compile(), client).invoke({"log": []})
    assert [ste for *_, ste in client.hint_calls] == SUPERVISOR_STE

    # AutoGen: the same shape as a GraphFlow (a conditional edge to each worker, "any" edges back)
    nodes = {"supervisor": DiGraphNode(name="supervisor", edges=[DiGraphEdge(target=w, condition=w) for w in WORKERS])}
    for w in WORKERS:
        nodes[w] = DiGraphNode(name=w, edges=[DiGraphEdge(target="supervisor", activation_condition="any")])
    inst = Instrumentation(step_graph=graph_from_digraph(DiGraph(nodes=nodes)), client=InstantClient())

    async def turns() -> None:
        for agent in SUPERVISOR_TURNS:
            await inst.turn_started(agent)
            inst.turn_finished(agent)

    asyncio.run(turns())
    assert [h.steps for h in inst.hint_log] == SUPERVISOR_STE


def test_agent_from_metadata() -> None:
    assert agent_from_metadata({"langgraph_checkpoint_ns": "writer:1|draft:2", "langgraph_node": "draft"}) == "writer"
    assert agent_from_metadata({"langgraph_node": "a"}) == "a"
    assert agent_from_metadata(None) is None


# -- run time with an instant client ----------------------------------------------------------------


def test_hints_learning_and_passthrough_with_instant_client() -> None:
    client = InstantClient("fine")
    model = KvbatonChatModel(client=client, max_tokens=4)
    app = build_graph(lambda name, messages: model.invoke(messages))
    wrapped = wrap(app, client)
    assert wrapped.step_graph.routers["planner"] is None  # wildcard before running
    inputs = {"messages": [SystemMessage("You are a team."), HumanMessage("Go.")], "rounds": 0}
    out = wrapped.invoke(inputs)
    calls = list(client.calls)
    plain = app.invoke(inputs)  # the unwrapped app: same output (handle ids aside)
    assert [m.content for m in plain["messages"]] == [m.content for m in out["messages"]]
    # the wildcard was learned from the observed hops, then narrowed
    assert set(wrapped.step_graph.routers["planner"]) == {"researcher", "coder"}
    assert set(wrapped.learned["planner"]) == {"researcher", "coder"}
    # one agent per call, taken from the running node
    agents = [c["agent"] for c in calls]
    assert agents[0] == "planner" and agents[-1] == "summarizer" and set(agents[1:3]) == {"researcher", "coder"}
    # fixed prompts registered once per agent (the leading system message)
    assert set(client.agents) == {"planner", "researcher", "coder", "reviewer", "summarizer"}
    assert client.agents["planner"] == [{"role": "system", "content": "You are a team."}]
    # every call after the first passed the latest handle on the prompt, and reused its prefix
    assert calls[0]["handle"] is None
    assert all(c["handle"] is not None for c in calls[1:])
    for msg in out["messages"]:
        if isinstance(msg, AIMessage):
            assert msg.additional_kwargs[KVBATON_KEY]["agent"] in client.agents
    later = [m for m in out["messages"] if isinstance(m, AIMessage)][1:]
    assert all(m.usage_metadata["input_token_details"]["cache_read"] > 0 for m in later)
    # stream and batch go through the wrapper too (same outputs as the app)
    n = len(client.hint_calls)
    updates = list(wrapped.stream(inputs, stream_mode="updates"))
    assert next(iter(updates[0])) == "planner" and len(client.hint_calls) > n
    assert len(wrapped.batch([inputs, inputs])) == 2
    assert asyncio.run(wrapped.ainvoke(inputs))["rounds"] == 2


def test_handle_selection_and_stale_handles() -> None:
    client = InstantClient("hello")
    model = KvbatonChatModel(client=client)
    first = model.invoke([HumanMessage("a")])
    other = model.invoke([HumanMessage("unrelated")])
    # two handles on the prompt: the one sharing the longer token prefix wins (not the latest)
    model.invoke([HumanMessage("a"), first, HumanMessage("b"), other])
    assert client.calls[-1]["handle"].id == first.additional_kwargs[KVBATON_KEY]["handle"]["id"] == handle_of(first)
    # a released handle falls back to plain prefill instead of failing
    client.release(first.additional_kwargs[KVBATON_KEY]["handle"]["id"])
    reply = model.invoke([HumanMessage("a"), first, HumanMessage("c")])
    assert reply.content == "hello" and client.calls[-1]["handle"] is None
    assert KvbatonChatModel(client=client, pass_handles=False).invoke([HumanMessage("a"), first]).content == "hello"
    assert client.calls[-1]["handle"] is None


def test_tools_and_structured_output() -> None:
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    client = InstantClient('Sure.\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    model = KvbatonChatModel(client=client).bind_tools([add])
    msg = model.invoke([SystemMessage("Be terse."), HumanMessage("2+3?")])
    assert msg.content == "Sure." and msg.tool_calls[0]["name"] == "add" and msg.tool_calls[0]["args"] == {"a": 2, "b": 3}
    sent = client.calls[-1]["messages"]
    assert sent[0]["role"] == "system" and "Be terse." in sent[0]["content"] and '"name": "add"' in sent[0]["content"]
    # the tool call and its result are rendered back into the next prompt
    model.invoke([HumanMessage("2+3?"), msg, ToolMessage("5", tool_call_id=msg.tool_calls[0]["id"])])
    rendered = client.calls[-1]["messages"]
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in rendered[-2]["content"]
    assert rendered[-1] == {"role": "tool", "content": "<tool_response>5</tool_response>"}  # the one convention
    # streaming with tools: one final chunk with the parsed call
    chunks = list(model.stream([HumanMessage("2+3?")]))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.tool_calls[0]["args"] == {"a": 2, "b": 3} and KVBATON_KEY in merged.additional_kwargs

    class Weather(BaseModel):
        city: str
        celsius: int

    structured = KvbatonChatModel(client=InstantClient('{"city": "Oslo", "celsius": 3}')).with_structured_output(Weather)
    assert structured.invoke("Weather in Oslo?") == Weather(city="Oslo", celsius=3)
    assert parse_tool_calls("no call here", ["add"]) == ("no call here", [])


def test_async_streaming_on_a_sync_client() -> None:
    # a sync client under astream: its stream runs in worker threads, text chunks then the handle
    client = InstantClient("one two three")
    model = KvbatonChatModel(client=client)

    async def collect() -> list[Any]:
        return [c async for c in model.astream([HumanMessage("Count.")])]

    chunks = asyncio.run(collect())
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.content == "one two three" and len(chunks) == 4
    assert handle_of(merged) == f"{len(client.calls):032x}" and client.calls[-1]["handle"] is None


# -- the real engine --------------------------------------------------------------------------------


class Spy:
    """A kvbaton client that records hints (with the STE they mean at call time) and delegates."""

    def __init__(self, inner: EmbeddedClient) -> None:
        self.inner = inner
        self.hint_calls: list[tuple[frozenset[str], frozenset[str], dict[str, float]]] = []
        self.registered: dict[str, Any] = {}

    def hints(self, steps: Any, *, running: Any = (), finished: Any = ()) -> dict[str, float]:
        ste = steps.steps_to_execution(running, finished)
        self.hint_calls.append((frozenset(running), frozenset(finished), ste))
        inner = getattr(self.inner, "hints", None) or self.inner.engine.hints
        inner(steps, running=running, finished=finished)
        return ste

    def register_agent(self, name: str, fixed_prompt: Any, *, prefill: bool = False) -> Any:
        self.registered[name] = fixed_prompt
        return self.inner.engine.register_agent(name, fixed_prompt, prefill=prefill)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def client() -> Any:
    # No prefix cache: every reused token in these tests comes from a handle passed on a message.
    c = kvbaton.connect(kv_budget="96MiB", prefix_cache=False)
    yield c
    c.close()


def _supervisor(model: KvbatonChatModel) -> Any:
    """planner -(wildcard fan-out)-> {researcher, coder} -join-> reviewer -router-> planner (cycle) |
    summarizer (a subgraph: draft -> polish). Each agent appends its instruction and its answer."""

    def agent(name: str) -> Any:
        def node(state: State) -> dict[str, Any]:
            ask = HumanMessage(f"{name}: one word.")
            return {"messages": [ask, model.invoke([*state["messages"], ask])]}

        return node

    def planner(state: State) -> dict[str, Any]:
        return {**agent("planner")(state), "rounds": state.get("rounds", 0) + 1}

    inner = StateGraph(State)
    inner.add_node("draft", agent("draft"))
    inner.add_node("polish", agent("polish"))
    inner.add_edge(START, "draft")
    inner.add_edge("draft", "polish")
    g = StateGraph(State)
    g.add_node("planner", planner)
    for name in ("researcher", "coder", "reviewer"):
        g.add_node(name, agent(name))
    g.add_node("summarizer", inner.compile())
    g.add_edge(START, "planner")
    g.add_conditional_edges("planner", lambda s: ["researcher", "coder"])
    g.add_edge(["researcher", "coder"], "reviewer")
    g.add_conditional_edges("reviewer", lambda s: "again" if s["rounds"] < 2 else "done",
                            {"again": "planner", "done": "summarizer"})
    g.add_edge("summarizer", END)
    return g.compile()


INPUTS = {"messages": [SystemMessage("You are a small team."), HumanMessage("Name a color.")], "rounds": 0}


def test_supervisor_graph_on_the_engine(client: Any) -> None:
    spy = Spy(client)
    app = wrap(_supervisor(KvbatonChatModel(client=spy, max_tokens=4)), spy)
    sg = app.step_graph
    assert sg.entry_points == ("planner",)
    assert sg.to_spec().triggers == {"reviewer": (("coder", "researcher"),)}
    assert sg.routers == {"planner": None, "reviewer": ("planner", "summarizer")}
    assert "summarizer" in app.subgraphs

    out = app.invoke(INPUTS)

    # -- hints: one per node start, in step order; the last of each step names all its nodes
    steps: list[tuple[frozenset[str], frozenset[str], dict[str, float]]] = []
    for running, finished, ste in spy.hint_calls:
        if steps and running > steps[-1][0]:
            steps[-1] = (running, finished, ste)  # a later start of the same step
        else:
            steps.append((running, finished, ste))
    both = frozenset({"researcher", "coder"})
    assert [s[0] for s in steps] == [frozenset({"planner"}), both, frozenset({"reviewer"}), frozenset({"planner"}),
                                    both, frozenset({"reviewer"}), frozenset({"summarizer"})]
    # step 1: nothing known yet about planner's wildcard router, so everything is one step away
    assert steps[0][2] == {"planner": 0, "researcher": 1, "coder": 1, "reviewer": 1, "summarizer": 1}
    # step 3: the wildcard was narrowed to the observed hops; join sources just finished
    assert steps[2][1] == both
    assert steps[2][2] == {"planner": 1, "researcher": 2, "coder": 2, "reviewer": 0, "summarizer": 1}
    # step 4 (the cycle): the join waits for both workers (max); the reviewer picked the planner, so the
    # summarizer it did not pick is as far as the reviewer's next run makes it (min over its router)
    assert steps[3][1] == frozenset()
    assert steps[3][2] == {"planner": 0, "researcher": 1, "coder": 1, "reviewer": 2, "summarizer": 3}
    assert steps[4][2]["reviewer"] == 1
    # last step: the subgraph's inner nodes are the summarizer agent, they send no hints of their own; the
    # reviewer picked the exit, so nothing else can run again in this round
    assert steps[6][2] == {"planner": INF, "researcher": INF, "coder": INF, "reviewer": INF, "summarizer": 0}
    assert set(sg.routers["planner"]) == {"researcher", "coder"}

    # -- handles on messages, agent identity (subgraph calls count for the outer node)
    ai = [m for m in out["messages"] if isinstance(m, AIMessage)]
    assert len(ai) == 10
    agents = [m.additional_kwargs[KVBATON_KEY]["agent"] for m in ai]
    assert agents[0] == "planner" and agents[-2:] == ["summarizer", "summarizer"]
    for m in ai:
        handle = kvbaton.Handle.model_validate(m.additional_kwargs[KVBATON_KEY]["handle"])
        assert handle.num_tokens > 0
    assert set(spy.registered) == {"planner", "researcher", "coder", "reviewer", "summarizer"}
    if "agent" in inspect.signature(client.generate).parameters:  # clients that take agent= keep per-agent stats
        assert set(spy.registered) <= set(client.stats().agents)

    # -- downstream agents reused the upstream KV through the handles (no prefix cache here)
    reused = [m.usage_metadata["input_token_details"]["cache_read"] for m in ai]
    prompt = [m.usage_metadata["input_tokens"] for m in ai]
    assert reused[0] == 0
    assert all(r > 0 for r in reused[1:])
    assert reused[-1] > prompt[-1] // 2  # the last call re-prefilled only its own suffix and seams
    assert client.stats().tokens_reused >= sum(reused)

    # -- the same greedy output without handles (plain prefill of the same prompts; reuse="exact": no
    # spans of other agents' handles either)
    baseline = _supervisor(KvbatonChatModel(client=client, max_tokens=4, pass_handles=False, reuse="exact")).invoke(
        INPUTS
    )
    base_ai = [m for m in baseline["messages"] if isinstance(m, AIMessage)]
    assert [m.content for m in base_ai] == [m.content for m in ai]
    assert all(m.usage_metadata["input_token_details"]["cache_read"] == 0 for m in base_ai)


def test_checkpointer_interrupt_async_and_streaming(client: Any) -> None:
    model = KvbatonChatModel(client=AsyncEmbeddedClient(client=client), max_tokens=4)

    async def ask(state: State) -> dict[str, Any]:
        q = HumanMessage("One word:")
        return {"messages": [q, await model.ainvoke([*state["messages"], q])]}

    app = wrap(chain(State, {"first": ask, "second": ask}).compile(checkpointer=InMemorySaver(),
                                                                 interrupt_before=["second"]))
    assert app.client is None  # adopted from the first KvbatonChatModel call
    config = {"configurable": {"thread_id": "t1"}}

    async def scenario() -> tuple[Any, list[Any]]:
        await app.ainvoke({"messages": [HumanMessage("Hi.")], "rounds": 0}, config)
        state = await app.aget_state(config)  # delegated to the app
        assert state.next == ("second",)
        stored = state.values["messages"][-1]
        assert KVBATON_KEY in stored.additional_kwargs  # the handle survived the checkpointer
        chunks = [c async for c in app.astream(None, config, stream_mode="messages")]
        return await app.aget_state(config), chunks

    final, chunks = asyncio.run(scenario())
    assert app.client is client
    msgs = final.values["messages"]
    assert len(msgs) == 5 and isinstance(msgs[-1], AIMessage)
    assert msgs[-1].usage_metadata["input_token_details"]["cache_read"] > 0  # reused "first"'s handle
    assert any(getattr(c[0], "content", "") for c in chunks)  # tokens streamed through the graph
    assert all(c[1]["langgraph_node"] == "second" for c in chunks)

    # sync streaming of the chat model on the real engine: text chunks, then the handle
    sync_model = KvbatonChatModel(client=client, max_tokens=4)
    pieces = list(sync_model.stream([HumanMessage("Hi.")]))
    merged = pieces[0]
    for p in pieces[1:]:
        merged += p
    assert merged.content == sync_model.invoke([HumanMessage("Hi.")]).content
    assert KVBATON_KEY in merged.additional_kwargs and isinstance(merged.additional_kwargs[KVBATON_KEY]["handle"], dict)


# -- mode 2: an unmodified ChatOpenAI app against a real `kvbaton serve` ----------------------------


def test_chat_openai_app_against_kvbaton_serve(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_BASE", raising=False)
    # the app as its author wrote it: ChatOpenAI with no base URL (it would go to api.openai.com)
    llm = langchain_openai.ChatOpenAI(model="smollm2-135m-instruct", api_key="sk-unused", max_tokens=4,
                                      temperature=0, max_retries=0, timeout=60)

    def node(name: str) -> Any:
        def fn(state: State) -> dict[str, Any]:
            ask = HumanMessage(f"{name}: one word.")
            return {"messages": [ask, llm.invoke([SystemMessage(f"You are the {name}."), *state["messages"], ask])],
                    "rounds": state.get("rounds", 0) + (name == "planner")}

        return fn

    g = chain(State, {"planner": node("planner"), "worker": node("worker")}, end=False)
    g.add_conditional_edges("worker", lambda s: "planner" if s["rounds"] < 2 else END)
    app = wrap(g.compile(), base_url=server.url, redirect_openai=True)
    sent: list[Any] = []
    control_hints = app.client.hints
    app.client.hints = lambda steps, **kw: sent.append((kw, control_hints(steps, **kw)))  # type: ignore[method-assign]

    out = app.invoke({"messages": [HumanMessage("Name a fruit.")], "rounds": 0})

    ai = [m for m in out["messages"] if isinstance(m, AIMessage)]
    assert len(ai) == 4
    assert [m.additional_kwargs[KVBATON_KEY]["agent"] for m in ai] == ["planner", "worker", "planner", "worker"]
    assert all(len(m.additional_kwargs[KVBATON_KEY]["handle"]["id"]) == 32 for m in ai)
    # the server knew each call's agent and reused the agent's previous KV on its second turn
    with server.http() as http:
        stats = http.get("/v1/kv/stats").json()
    assert {"planner", "worker"} <= set(stats["agents"])
    assert ai[2].usage_metadata["input_token_details"]["cache_read"] > 0
    # hints went to the server before each step, and the learned router is in the graph
    assert [tuple(kw["running"]) for kw, _ in sent] == [("planner",), ("worker",), ("planner",), ("worker",)]
    assert sent[1][1]["worker"] == 0 and sent[1][1]["planner"] == 1
    assert app.step_graph.routers["worker"] == ("planner",)
    # outside the wrapper the same model is untouched: no header, no redirect
    from kvbaton.adapters.langgraph.openai_dropin import CURRENT_CALL

    assert CURRENT_CALL.get() is None
