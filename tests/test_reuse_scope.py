"""Issue 46, item 5: every adapter run is a reuse session. A new run's first agent never places K/V an earlier,
unrelated run computed (approximately) unless the runs name one session on purpose; inside a run the agents
still reuse each other's documents. The real engine (one long-lived engine per module, fresh ones where a
test says so), a ~200-token document read behind a per-run reference line (the run's input), ``reuse="rotate"``
(it never falls back, so whether a span was placed shows in the marks), 2 tokens per answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("langgraph")
pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_ext.models.replay import ReplayChatCompletionClient
from kvbaton.adapters.autogen import instrument
from kvbaton.adapters.langgraph import KvbatonChatModel, wrap
from kvbaton.bench.corpus import document
from kvbaton.embedded import EmbeddedClient
from kvbaton.errors import InvalidRequest
from kvbaton.http import HttpClient
from kvbaton.scope import Scope, current_session
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

DOC = document(150, seed=46)


class Reading(TypedDict):
    ref: str
    marks: list[dict[str, Any]]


@pytest.fixture(scope="module")
def kv() -> Iterator[EmbeddedClient]:
    from kvbaton.backend import Engine

    engine = Engine(kv_budget="128MiB")
    yield EmbeddedClient(engine=engine)
    engine.close()


def fresh() -> EmbeddedClient:
    from kvbaton.backend import Engine

    return EmbeddedClient(engine=Engine(kv_budget="64MiB"))


def reading_app(client: EmbeddedClient, **wrap_options: Any) -> Any:
    """reader -> reviewer, each reading the run's reference line and the document behind its own persona."""

    def node(role: str) -> Any:
        model = KvbatonChatModel(client=client, agent=f"scope-{role}", reuse="rotate", max_tokens=2)

        def fn(state: Reading) -> dict[str, Any]:
            reply = model.invoke([SystemMessage(f"You are the {role} of this run."),
                                  HumanMessage(f"Reference: {state['ref']}\n{DOC}\n\nSummarize.")])
            return {"marks": [*state["marks"], reply.response_metadata["kvbaton"]]}

        return fn

    graph = StateGraph(Reading)
    graph.add_node("reader", node("reader"))
    graph.add_node("reviewer", node("reviewer"))
    graph.add_edge(START, "reader")
    graph.add_edge("reader", "reviewer")
    graph.add_edge("reviewer", END)
    return wrap(graph.compile(), client, **wrap_options)


def marks(app: Any, ref: str, **config: Any) -> list[dict[str, Any]]:
    return app.invoke({"ref": ref, "marks": []}, config or None)["marks"]


def placed(mark: dict[str, Any]) -> bool:
    return bool(mark["segments"]) and not mark["exact"]


def test_langgraph_runs_on_a_long_lived_engine_reuse_only_their_own_run(kv):
    app = reading_app(kv)
    first = marks(app, "HP-894179-H")
    assert not placed(first[0]) and placed(first[1])  # inside a run the reviewer reuses the reader's document
    second = marks(app, "KQ-120934-B")  # the same app, an unrelated run: another reference line
    assert second[0]["exact"] and second[0]["segments"] == []  # read densely: nothing of the first run placed
    assert placed(second[1])
    # a thread is one session across its runs (as on a server); another thread is not
    marks(app, "ZT-555001-A", configurable={"thread_id": "t-46"})
    again = marks(app, "ZT-777002-C", configurable={"thread_id": "t-46"})
    assert placed(again[0])
    assert not placed(marks(app, "ZT-999003-D", configurable={"thread_id": "t-47"})[0])


def test_langgraph_reuse_across_runs_is_asked_for_by_naming_a_session(kv):
    app = reading_app(kv, session="shared-46")
    marks(app, "AB-100001-A")
    assert placed(marks(app, "AB-100002-B")[0])  # asked for: the second run's reader places the first run's spans
    assert not placed(marks(reading_app(kv), "AB-100003-C")[0])  # another app, its own runs


def test_a_fresh_engine_per_run_reads_densely_and_without_ownership_too():
    for ref in ("FR-000001-A", "FR-000002-B"):
        client = fresh()
        try:
            first, second = marks(reading_app(client, release_handles=False), ref)
            assert first["exact"] and first["segments"] == [] and placed(second)
        finally:
            client.engine.close()


def team(name: str, client: EmbeddedClient, **options: Any) -> RoundRobinGroupChat:
    agents = [AssistantAgent(f"{name}_{role}", model_client=ReplayChatCompletionClient(["unused"]),
                             system_message=f"You are the {role} of team {name}.") for role in ("reader", "critic")]
    out = RoundRobinGroupChat(agents, max_turns=2)
    instrument(out, client, max_tokens=2, reuse="rotate", **options)
    return out


def exact_marks(result: Any) -> list[str]:
    return [m.metadata.get("kvbaton_exact") for m in result.messages if m.source != "user"]


def test_autogen_teams_reuse_only_their_own_conversation(kv):
    task = f"Reference: TM-{{}}\n{DOC}\n\nSummarize."

    async def runs() -> None:  # one event loop: a team runs again only on the loop it first ran on
        assert exact_marks(await team("first", kv).run(task=task.format("111111-A"))) == ["true", "false"]
        other = team("second", kv)
        assert exact_marks(await other.run(task=task.format("222222-B"))) == ["true", "false"]
        await other.reset()  # a reset team starts a new conversation: a new session
        assert exact_marks(await other.run(task=task.format("333333-C")))[0] == "true"
        # reuse across runs, asked for: two teams that name one session
        await team("third", kv, session="teams-46").run(task=task.format("444444-D"))
        shared = await team("fourth", kv, session="teams-46").run(task=task.format("555555-E"))
        assert exact_marks(shared) == ["false", "false"]

    asyncio.run(runs())


# -- the session itself, no model --------------------------------------------------------------------------


@pytest.mark.unit
def test_the_innermost_scope_with_a_session_names_it_and_an_http_client_sends_it():
    seen: list[str | None] = []
    http = HttpClient("http://kvbaton.test", transport=httpx.MockTransport(
        lambda request: seen.append(request.headers.get("x-kvbaton-session")) or httpx.Response(200, json={})))
    assert current_session() is None
    http.health()
    with Scope(session="outer"):
        with Scope(name="no session of its own"):
            assert current_session() == "outer"
            http.health()
        with Scope(session="inner"):
            http.health()
    assert seen == [None, "outer", "inner"]
    with pytest.raises(InvalidRequest, match="session"):
        Scope(session="")


@pytest.mark.unit
def test_an_in_process_engine_reads_the_reuse_session_of_the_callers_scope():
    # As an HTTP client sends it in X-Kvbaton-Session: the adapters only open the scope, and pass plain names.
    from kvbaton.backend.cluster.remote import _caller_agent
    from kvbaton.backend.tenants import AgentRef

    assert AgentRef.of("reader") == AgentRef(None, "reader", None)  # no session: the agent as given
    with Scope(session="run-1"):
        assert AgentRef.of("reader") == AgentRef(None, "reader", "run-1")
        assert AgentRef.of(None).session == "run-1"
        tagged = AgentRef("t-1", "reader", "server-session")  # a server's own, kept as it is
        assert AgentRef.of(tagged) is tagged
        # a cluster resolves it where the caller is, before a worker (which has no scope) sees the request
        assert _caller_agent({"agent": "reader", "mode": "auto"}) == {"agent": AgentRef(None, "reader", "run-1"),
                                                                     "mode": "auto"}
        assert _caller_agent({"mode": "auto"}) == {"mode": "auto"}
    assert AgentRef.of("reader").session is None
