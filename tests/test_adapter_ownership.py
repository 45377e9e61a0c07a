"""Adapters own what their runs create (issue 20): a run of a wrapped LangGraph app releases the
handles it made except those its final state / latest checkpoint references (kept per thread until
the thread's next run supersedes them or ``app.release(thread_id)``); an AutoGen team run releases
all but each agent's latest reply, and ``KvbatonChatCompletionClient.close()`` everything it made —
over HTTP too. Real model (SmolLM2-135M, greedy, 2 tokens), real LangGraph / AutoGen, a real
``kvbaton serve`` where the test says HTTP."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any, TypedDict

import kvbaton
import pytest

pytest.importorskip("langgraph")
pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_core.models import SystemMessage as AgSystemMessage
from autogen_core.models import UserMessage
from autogen_ext.models.replay import ReplayChatCompletionClient
from kvbaton.adapters.autogen import KvbatonChatCompletionClient, instrument
from kvbaton.adapters.ownership import referenced_ids
from kvbaton.adapters.langgraph import KvbatonChatModel, handle_of, wrap
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph, add_messages


class State(TypedDict):
    messages: Annotated[list, add_messages]


@pytest.fixture(scope="module")
def client() -> Any:
    # A small pool (a few hundred tokens) and no prefix cache: 20 leaking runs would exhaust it, and
    # every reused token comes from a handle on a message.
    c = kvbaton.connect(kv_budget="24MiB", prefix_cache=False)
    yield c
    c.close()


def _two_agents(model: KvbatonChatModel, client: Any, scratch: list[Any], **compile: Any) -> Any:
    """a -> b; ``a`` also materializes a scratch handle it does not put in the state, and keeps
    (``client.keep``) the fourth one."""

    def node(name: str) -> Any:
        def fn(state: State) -> dict[str, Any]:
            if name == "a":
                scratch.append(client.materialize(f"scratch {len(scratch)}"))
                if len(scratch) == 4:
                    client.keep(scratch[-1])
            ask = HumanMessage(f"{name}: one word.")
            return {"messages": [ask, model.invoke([*state["messages"], ask])]}

        return fn

    g = StateGraph(State)
    g.add_node("a", node("a"))
    g.add_node("b", node("b"))
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    g.add_edge("b", END)
    return g.compile(**compile)


def _inputs(i: int) -> dict[str, Any]:
    return {"messages": [SystemMessage("You are brief."), HumanMessage(f"Name a color ({i}).")]}


def _refs(messages: list[Any]) -> set[str]:
    return {h for m in messages if isinstance(m, AIMessage) and (h := handle_of(m))}


@pytest.mark.unit
def test_referenced_ids_walks_states() -> None:
    h = "ab" * 16
    state = {"messages": [AIMessage("x", additional_kwargs={"kvbaton": {"handle": {"id": h, "lineage": [[1] * 9]}}})],
             "saved": ("cd" * 16, {"nested": ["not an id", 42]}), "other": "ef" * 16 + "0"}
    assert referenced_ids(state) == {h, "cd" * 16}


def test_repeated_invocations_keep_live_handles_bounded(client: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvbaton.scope")
    scratch: list[Any] = []
    app = wrap(_two_agents(KvbatonChatModel(client=client, max_tokens=2), client, scratch), client)
    base = client.stats().handles_live
    for i in range(20):
        out = app.invoke(_inputs(i))
        refs = _refs(out["messages"])
        assert len(refs) == 2
        # live: what the final state references, plus the scratch handle the node kept
        assert client.stats().handles_live == base + len(refs) + (i >= 3)
        assert set(app.retained()) == refs
    assert "released" in caplog.text and "kvbaton langgraph run" in caplog.text
    # stream, async and batch runs are scopes too; a batch keeps what each of its results references
    chunks = list(app.stream(_inputs(20), stream_mode="values"))
    assert set(app.retained()) == _refs(chunks[-1]["messages"])
    out = asyncio.run(app.ainvoke(_inputs(21)))
    assert set(app.retained()) == _refs(out["messages"])
    outs = app.batch([_inputs(22), _inputs(23)])
    both = _refs(outs[0]["messages"]) | _refs(outs[1]["messages"])
    assert set(app.retained()) == both and client.stats().handles_live == base + 4 + 1
    app.release()
    assert client.stats().handles_live == base + 1
    client.release(scratch[3])  # only the user's own release frees a kept handle
    assert client.stats().handles_live == base


def test_a_checkpointed_thread_keeps_what_its_checkpoint_references(client: Any) -> None:
    scratch: list[Any] = []
    app = wrap(_two_agents(KvbatonChatModel(client=client, max_tokens=2), client, scratch,
                           checkpointer=InMemorySaver()), client)
    base = client.stats().handles_live
    t1, t2 = ({"configurable": {"thread_id": t}} for t in ("t1", "t2"))
    app.invoke(_inputs(0), t1)
    app.invoke(_inputs(1), t2)
    refs1 = _refs(app.get_state(t1).values["messages"])
    assert set(app.retained("t1")) == refs1 and len(refs1) == 2
    assert client.stats().handles_live == base + 4
    # the thread's next run finds its handles: its first call reuses the checkpointed KV
    out = app.invoke({"messages": [HumanMessage("Again.")]}, t1)
    ai = [m for m in out["messages"] if isinstance(m, AIMessage)]
    assert len(ai) == 4 and ai[2].usage_metadata["input_token_details"]["cache_read"] > 0
    refs1 = _refs(app.get_state(t1).values["messages"])
    assert set(app.retained("t1")) == refs1 and len(refs1) == 4  # all still in the checkpoint
    assert client.stats().handles_live == base + 4 + 2
    app.release("t1")
    assert client.stats().handles_live == base + 2
    app.release("t2")
    assert client.stats().handles_live == base


# -- AutoGen ----------------------------------------------------------------------------------------


def _assistant(name: str) -> AssistantAgent:
    return AssistantAgent(name, system_message=f"You are {name}. Be brief.",
                          model_client=ReplayChatCompletionClient(["unused"]))


def test_autogen_team_runs_and_close_release_over_http(server: Any) -> None:
    http = kvbaton.connect(server.url)
    try:
        base = http.stats().handles_live
        team = instrument(RoundRobinGroupChat([_assistant("a"), _assistant("b")], max_turns=4), http, max_tokens=2)

        async def runs() -> list[int]:
            live = []
            for _ in range(3):  # the conversation goes on across runs (one event loop: autogen's rule)
                await team.run(task="Hello.")
                live.append(http.stats().handles_live - base)
            return live

        # each agent holds its latest reply for the next run; the rest of each run was released
        assert asyncio.run(runs()) == [2, 2, 2]
        solo = KvbatonChatCompletionClient(http, max_tokens=2)  # no agent: no side table
        messages = [AgSystemMessage(content="Be brief."), UserMessage(content="Say hi.", source="user")]

        async def chat() -> None:
            await solo.create(messages)
            [c async for c in solo.create_stream(messages)]
            await solo.create(messages)

        asyncio.run(chat())
        kept = solo.last_handle
        http.keep(kept)
        assert http.stats().handles_live > base + 1

        async def close_all() -> None:
            for model_client in team.kvbaton.model_clients.values():
                await model_client.close()
            await solo.close()

        asyncio.run(close_all())
        assert http.stats().handles_live == base + 1  # everything but what the user kept
        http.release(kept)
        assert http.stats().handles_live == base
    finally:
        from kvbaton.adapters import autogen as ka

        ka.register_connection(None, server.url)
        http.close()
