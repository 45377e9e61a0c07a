"""Adapters own what their runs create (issue 20): a run of a wrapped LangGraph app releases the
handles it made except those its final state / latest checkpoint references (kept per thread until
the thread's next run supersedes them or ``app.release(thread_id)``, at most ``max_retained_handles``
per thread); an AutoGen team run releases all but each agent's latest reply, ``team.reset()`` all of
them, and ``KvbatonChatCompletionClient.close()`` everything it made — also when the app closes the
model client it built and ``instrument`` replaced — over HTTP too. A ChatOpenAI app (mode 2) run
without a ``thread_id`` leaves on the server only what its latest result names.

Retained handles are a cache, not a reservation (issue 39): a checkpointer app with many threads on
a small pool never makes an unrelated request fail, and the answers of its later turns stay those of
a fresh engine where exact.

Real model (SmolLM2-135M, greedy, 2-4 tokens), real LangGraph / AutoGen, a real ``kvbaton serve``
where the test says HTTP."""

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
from autogen_core import CancellationToken
from autogen_core.models import SystemMessage as AgSystemMessage
from autogen_core.models import UserMessage
from autogen_ext.models.replay import ReplayChatCompletionClient
from kvbaton.adapters.autogen import KvbatonChatCompletionClient, instrument
from kvbaton.adapters.langgraph import KvbatonChatModel, handle_of, wrap
from kvbaton.adapters.ownership import MAX_RETAINED_HANDLES, referenced_ids
from kvbaton.bench.corpus import document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import add_messages
from langgraph_apps import chain


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

    return chain(State, {"a": node("a"), "b": node("b")}).compile(**compile)


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


def test_team_reset_and_closing_the_apps_own_client_release_what_instrument_made(server: Any) -> None:
    openai_models = pytest.importorskip("autogen_ext.models.openai")
    http = kvbaton.connect(server.url)
    try:
        base = http.stats().handles_live

        def app_client() -> Any:  # the app's own client, pointed at the kvbaton server
            return openai_models.OpenAIChatCompletionClient(
                model="smollm2-135m-instruct", base_url=f"{server.url}/v1", api_key="unused", max_tokens=2,
                temperature=0, model_info={"vision": False, "function_calling": False, "json_output": False,
                                           "family": "unknown", "structured_output": False},
            )

        async def scenario() -> list[int]:
            live = []
            own = app_client()  # one client shared by both agents, as the AutoGen tutorials do
            team = instrument(RoundRobinGroupChat([
                AssistantAgent(n, system_message=f"You are {n}. Be brief.", model_client=own) for n in ("a", "b")
            ], max_turns=4))
            assert all(type(m).__name__ == "KvbatonChatCompletionClient" for m in team.kvbaton.model_clients.values())
            await team.run(task="Hello.")
            live.append(http.stats().handles_live - base)  # each agent's latest reply
            await team.reset()  # the conversation starts over: nothing of it is worth keeping
            live.append(http.stats().handles_live - base)
            await team.run(task="Hello again.")
            live.append(http.stats().handles_live - base)
            await own.close()  # the app closes the client it built: the substitutes go with it
            live.append(http.stats().handles_live - base)
            return live

        assert asyncio.run(scenario()) == [2, 0, 2, 0]
    finally:
        from kvbaton.adapters import autogen as ka

        ka.register_connection(None, server.url)
        http.close()


def test_an_autogen_client_retains_at_most_its_bound(client: Any) -> None:
    model = KvbatonChatCompletionClient(client, agent="bounded", max_tokens=2, max_retained_handles=2)
    assert KvbatonChatCompletionClient(client, max_tokens=2).dump_component().config["max_retained_handles"] == (
        MAX_RETAINED_HANDLES)
    base = client.stats().handles_live

    async def turns() -> list[str]:
        made = []
        for i in range(4):  # a long run: every reply is kept until the bound, then the oldest go first
            await model.create([AgSystemMessage(content="Be brief."), UserMessage(content=f"Count {i}.", source="u")])
            made.append(model.last_handle.id)
        return made

    made = asyncio.run(turns())
    assert model.owned_handles == made[-2:] and client.stats().handles_live == base + 2
    asyncio.run(model.close())
    assert client.stats().handles_live == base

    # a single instrumented agent: its on_reset releases what its model client holds, as team.reset() does
    solo = instrument(_assistant("solo"), client, max_tokens=2)

    async def run_and_reset() -> list[int]:
        await solo.run(task="Hello.")
        live = [client.stats().handles_live - base]
        await solo.on_reset(CancellationToken())
        return [*live, client.stats().handles_live - base]

    assert asyncio.run(run_and_reset()) == [1, 0]


def test_chat_openai_runs_without_a_thread_leave_only_the_latest_result(server: Any) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model="smollm2-135m-instruct", base_url=f"{server.url}/v1", api_key="unused",
                                      max_tokens=2, temperature=0, max_retries=0, timeout=60)

    def node(name: str) -> Any:
        def fn(state: State) -> dict[str, Any]:
            ask = HumanMessage(f"{name}: one word.")
            return {"messages": [ask, llm.invoke([SystemMessage(f"You are the {name}."), *state["messages"], ask])]}

        return fn

    app = wrap(chain(State, {"planner": node("planner"), "worker": node("worker")}).compile())
    with server.http() as http:
        def live() -> int:
            return int(http.get("/v1/kv/stats").json()["handles_live"])

        base = live()
        # the server retains each agent's latest turn per session; a run without a thread_id is a
        # session of its own, superseded by the next such run (it was 2, 4, 6, 8)
        held = []
        for i in range(4):
            app.invoke({"messages": [HumanMessage(f"Name a fruit ({i}).")]})
            held.append(live() - base)
        assert held == [2, 2, 2, 2]
        assert app.release() == 2 and live() == base
        thread = {"configurable": {"thread_id": "fruit-thread"}}
        for i in range(2):
            app.invoke({"messages": [HumanMessage(f"Name a fruit ({i}).")]}, thread)
            assert live() - base == 2  # a thread's session: its agents' latest turns, the next turn reuses them
        assert app.release("fruit-thread") == 2 and live() == base


class Turns(TypedDict):
    messages: Annotated[list, add_messages]


READER = "You are the reader. Summarize the notes for the team."
REVIEWER = "You are a strict reviewer of risks and owners."


def test_a_checkpointer_app_with_many_threads_on_a_small_pool() -> None:
    """Issue 39: each thread of a MemorySaver app holds its turns' handles, some approximate (the reviewer
    reuses the reader's notes behind its own system prompt); on a pool a few threads fill, an unrelated
    request after every thread still runs (before: PoolExhausted from the fourth thread on), a thread's
    later turn after its handles were spilled answers as a fresh engine does where it is exact, and no
    thread holds more than its bound."""
    small = kvbaton.connect(kv_budget="96 blocks")
    fresh = kvbaton.connect(kv_budget="384MiB", prefix_cache=False)
    calls: list[tuple[list[Any], AIMessage]] = []
    model = KvbatonChatModel(client=small, max_tokens=4, reuse="rotate")  # always approximates what it can

    def node(system: str, ask: str) -> Any:
        def fn(state: Turns) -> dict[str, Any]:
            prompt = [SystemMessage(system), *state["messages"], HumanMessage(ask)]
            answer = model.invoke(prompt)
            calls.append((prompt, answer))
            return {"messages": [prompt[-1], answer]}

        return fn

    app = wrap(chain(Turns, {"reader": node(READER, "Summarize."), "reviewer": node(REVIEWER, "Risk?")}).compile(
        checkpointer=InMemorySaver()), small, max_retained_handles=3)
    corpus = small.tokenize(document(3000, seed=7))
    threads = [{"configurable": {"thread_id": f"t{i}"}} for i in range(5)]
    failed = []
    try:
        for i, thread in enumerate(threads):
            out = app.invoke({"messages": [HumanMessage(f"Notes:\n{document(80, seed=100 + i)}")]}, thread)
            reader, reviewer = [m for m in out["messages"] if isinstance(m, AIMessage)]
            assert reader.response_metadata["kvbaton"]["exact"] and not reviewer.response_metadata["kvbaton"]["exact"]
            try:  # an unrelated request of 55 of the 96 blocks, distinct each time (no cache hit)
                result = small.complete(corpus[i * 880: (i + 1) * 880 - 8], max_tokens=4)
                small.release(result.handle)
            except kvbaton.KvbatonError as exc:
                failed.append(exc)
        assert failed == []
        stats = small.stats()
        assert stats.cache.handles_spilled > 0  # the pool was short: retained handles gave their blocks back
        assert stats.handles_live == sum(len(app.retained(t["configurable"]["thread_id"])) for t in threads) == 10

        # the first thread's next turn, its handles long spilled: rebuilt, and exact where the engine says so
        calls.clear()
        out = app.invoke({"messages": [HumanMessage("Who owns the first action?")]}, threads[0])
        exact = [(prompt, answer) for prompt, answer in calls if answer.response_metadata["kvbaton"]["exact"]]
        assert exact  # the reader's turn reuses its own (exact) prefix
        dense = KvbatonChatModel(client=fresh, max_tokens=4, reuse="exact", pass_handles=False)
        for prompt, answer in exact:
            assert answer.content == dense.invoke(prompt).content
        # four turns' handles are on the thread's checkpoint; it keeps the latest three
        assert len([m for m in out["messages"] if isinstance(m, AIMessage)]) == 4
        assert len(app.retained("t0")) == 3
        for thread in threads:
            app.release(thread["configurable"]["thread_id"])
        assert small.stats().handles_live == 0
    finally:
        small.close()
        fresh.close()
