"""The LangGraph/LangChain surfaces as an app author meets them: ``wrap(app)`` routes every chat model
through kvbaton or refuses, never sends the app's OpenAI key to a kvbaton server, tags each
session; the wrapped app is a Runnable (a node of another graph, a ``|`` pipe, ``with_config``,
``astream_events``) with hints and handles on every path; ``KvbatonChatModel`` is a conventional
chat model (no-argument construction, ``base_url``/``model``, kvbaton's tokenizer, compact handle
references). Real SmolLM2 (greedy, max_tokens 2-4) in process; real ``kvbaton serve`` processes
behind a recording loopback relay for mode 2."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator
from typing import Annotated, Any, TypedDict

import httpx
import pytest

pytest.importorskip("langgraph")

import kvbaton
from kvbaton.adapters import connections
from kvbaton.adapters.langgraph import KVBATON_KEY, ChatKvbaton, KvbatonChatModel, wrap
from kvbaton.errors import InvalidRequest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages
from langchain_core.runnables import RunnableLambda
from langgraph.graph import START, StateGraph, add_messages
from langgraph_apps import chain

MODEL = "smollm2-135m-instruct"
NOTES = "Notes: the blue team shipped the parser; the red team fixed three bugs; the green team wrote docs. "


class State(TypedDict):
    messages: Annotated[list, add_messages]


def two_agents(llm: Any) -> Any:
    """writer -> critic, each answering the conversation so far behind its own system prompt."""

    def node(name: str) -> Any:
        def fn(state: State) -> dict[str, Any]:
            ask = HumanMessage(f"{name}: one word.")
            return {"messages": [ask, llm.invoke([SystemMessage(f"You are the {name}."), *state["messages"], ask])]}

        return fn

    return chain(State, {"writer": node("writer"), "critic": node("critic")}).compile()


def ai(out: dict[str, Any]) -> list[AIMessage]:
    return [m for m in out["messages"] if isinstance(m, AIMessage)]


# -- wrap() refuses what it cannot route (no model, no server) --------------------------------------


@pytest.mark.unit
def test_wrap_refuses_an_openai_app_it_cannot_route(monkeypatch: pytest.MonkeyPatch) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    for var in ("KVBATON_URL", "OPENAI_BASE_URL", "OPENAI_API_BASE"):
        monkeypatch.delenv(var, raising=False)
    app = two_agents(langchain_openai.ChatOpenAI(model=MODEL, api_key="sk-openai-secret"))
    # the README's one line, with no server named: an error that names the missing argument
    with pytest.raises(InvalidRequest, match="base_url"):
        wrap(app)
    # a server named, the model left on api.openai.com: the redirect is opt-in
    with pytest.raises(InvalidRequest, match="redirect_openai=True"):
        wrap(app, base_url="http://127.0.0.1:9")
    # a chat model kvbaton cannot serve at all
    from langchain_core.language_models.fake_chat_models import FakeListChatModel

    with pytest.raises(InvalidRequest, match="FakeListChatModel"):
        wrap(two_agents(FakeListChatModel(responses=["x"])))


# -- mode 2: ChatOpenAI through a real kvbaton serve, seen by a recording relay -----------------------


class Relay:
    """A loopback HTTP relay in front of a server that records every request's headers."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.seen: list[dict[str, str]] = []
        relay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                relay.seen.append({k.lower(): v for k, v in self.headers.items()} | {":path": self.path})
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                answer = httpx.request(self.command, relay.target + self.path, content=body, headers=headers,
                                       timeout=120)
                self.send_response(answer.status_code)
                for k, v in answer.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = do_DELETE = relay

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def chat_requests(self) -> list[dict[str, str]]:
        return [h for h in self.seen if h[":path"].endswith("/chat/completions")]


@pytest.fixture
def relay(server: Any) -> Iterator[Relay]:
    r = Relay(server.url)
    yield r
    r.close()


def test_mode2_routes_without_the_openai_key_and_tags_sessions(relay: Relay, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    for var in ("KVBATON_URL", "KVBATON_TOKEN", "OPENAI_BASE_URL", "OPENAI_API_BASE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    # the app as its author wrote it: ChatOpenAI on api.openai.com with the key from the environment
    llm = langchain_openai.ChatOpenAI(model=MODEL, max_tokens=2, temperature=0, max_retries=0, timeout=120)
    app = wrap(two_agents(llm), base_url=relay.url, redirect_openai=True)
    out = app.batch([{"messages": [HumanMessage("Name a fruit.")]}, {"messages": [HumanMessage("Name a tree.")]}],
                    [{"configurable": {"thread_id": "t-1"}}, {"configurable": {"thread_id": "t-2"}}])
    assert all(m.additional_kwargs[KVBATON_KEY]["handle"]["id"] for o in out for m in ai(o))
    calls = relay.chat_requests()
    assert len(calls) == 4
    # the OpenAI key reached no kvbaton endpoint, nor did any Authorization without a kvbaton token
    assert not any("sk-openai-secret" in json.dumps(h) for h in relay.seen)
    assert not any("authorization" in h for h in relay.seen)
    # each call carries its agent and its session (the thread), so the two threads never collide
    assert sorted((h["x-kvbaton-session"], h["x-kvbaton-agent"]) for h in calls) == [
        ("t-1", "critic"), ("t-1", "writer"), ("t-2", "critic"), ("t-2", "writer")]
    # without a thread_id each invocation is its own session
    app.invoke({"messages": [HumanMessage("Name a bird.")]})
    sessions = {h["x-kvbaton-session"] for h in relay.chat_requests()[4:]}
    assert len(sessions) == 1 and not sessions & {"t-1", "t-2"}
    # streamed calls reach the server too (their handle comes later): no "did not reach" warning
    list(app.stream({"messages": [HumanMessage("Name a stone.")]}, stream_mode="messages"))
    assert "did not reach" not in caplog.text


def test_mode2_sends_the_kvbaton_token_and_adopts_the_models_own_server(
    secure_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    for var in ("KVBATON_URL", "KVBATON_TOKEN", "OPENAI_BASE_URL", "OPENAI_API_BASE"):
        monkeypatch.delenv(var, raising=False)
    relay = Relay(secure_server.url)
    try:
        # the model already points at the kvbaton server: wrap(app) finds it there, no argument needed;
        # its api_key is an OpenAI key, replaced by the kvbaton token
        llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{relay.url}/v1", api_key="sk-openai-secret",
                                          max_tokens=2, temperature=0, max_retries=0, timeout=120)
        monkeypatch.setenv("KVBATON_TOKEN", secure_server.token)
        app = wrap(two_agents(llm))
        assert app.base_url == f"{relay.url}/v1"
        out = app.invoke({"messages": [HumanMessage("Name a fruit.")]})
        assert [m.additional_kwargs[KVBATON_KEY]["agent"] for m in ai(out)] == ["writer", "critic"]
        assert {h.get("authorization") for h in relay.seen} == {f"Bearer {secure_server.token}"}
    finally:
        relay.close()


# -- mode 1: the wrapped app is a Runnable; KvbatonChatModel is a conventional chat model ---------


@pytest.fixture(scope="module")
def kv() -> Iterator[Any]:
    # no prefix cache: every reused token comes from a handle passed on a message
    c = kvbaton.connect(kv_budget="96MiB", prefix_cache=False)
    yield c
    c.close()


class Hints:
    """Records the hints a client receives (the real client still gets them)."""

    def __init__(self, client: Any) -> None:
        self.client, self.running = client, []
        self._hints = client.hints

    def __enter__(self) -> Hints:
        def hints(steps: Any, **kw: Any) -> Any:
            self.running.append(tuple(kw.get("running", ())))
            return self._hints(steps, **kw)

        self.client.hints = hints
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.client.hints


def test_wrapped_app_is_a_runnable_with_hints_and_handles_on_every_path(kv: Any) -> None:
    llm = KvbatonChatModel(client=kv, max_tokens=2)
    app = wrap(two_agents(llm), kv)
    start = {"messages": [HumanMessage("Name a fruit.")]}

    def handles(out: dict[str, Any]) -> list[str]:
        return [m.additional_kwargs[KVBATON_KEY]["agent"] for m in ai(out)]

    # a node of another graph (its nodes stay its agents: the outer node is not one of them)
    outer = StateGraph(State)
    outer.add_node("team", app)
    outer.add_edge(START, "team")
    with Hints(kv) as seen:
        out = outer.compile().invoke(start)
    assert handles(out) == ["writer", "critic"] and seen.running == [("writer",), ("critic",)]
    # a | pipe, and with_config (still the wrapper, sharing its step graph)
    with Hints(kv) as seen:
        out = (app | RunnableLambda(lambda s: s)).invoke(start)
    assert handles(out) == ["writer", "critic"] and seen.running == [("writer",), ("critic",)]
    configured = app.with_config(recursion_limit=10)
    assert type(configured) is type(app) and configured.step_graph is app.step_graph
    assert handles(configured.invoke(start)) == ["writer", "critic"]

    # astream_events: the run is the wrapper's (hints sent, handles on the streamed messages)
    async def events() -> list[Any]:
        return [e async for e in app.astream_events(start, version="v2")]

    with Hints(kv) as seen:
        got = asyncio.run(events())
    ends = [e for e in got if e["event"] == "on_chat_model_end"]
    assert len(ends) == 2 and all(KVBATON_KEY in e["data"]["output"].additional_kwargs for e in ends)
    assert seen.running == [("writer",), ("critic",)]
    with pytest.raises(NotImplementedError, match="v2"):
        app.astream_events(start, version="v3")


def test_chat_model_is_conventional(kv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBATON_URL", raising=False)
    # no arguments: the process-wide embedded connection (registered here, so no second engine loads)
    connections.register_connection(kv)
    try:
        llm = ChatKvbaton(max_tokens=2)
    finally:
        connections.register_connection(None)
    assert llm.client is kv and llm.model_name == kv.stats().model == MODEL
    with pytest.raises(ValueError, match="base_url"):
        KvbatonChatModel(client=kv, base_url="http://127.0.0.1:9")
    # counted with kvbaton's tokenizer, as the model reads the messages
    text = NOTES * 3
    assert llm.get_num_tokens(text) == len(kv.tokenize(text)) and llm.get_token_ids(text) == kv.tokenize(text)
    messages = [SystemMessage("You are terse."), HumanMessage(NOTES), AIMessage("Ok."), HumanMessage("Who fixed bugs?")]
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": NOTES},
            {"role": "assistant", "content": "Ok."}, {"role": "user", "content": "Who fixed bugs?"}]
    assert llm.get_num_tokens_from_messages(messages) == len(kv.chat_tokens(chat, add_generation_prompt=False))
    budget = llm.get_num_tokens_from_messages(messages[-2:]) + 2
    kept = trim_messages(messages, max_tokens=budget, token_counter=llm, strategy="last")
    assert kept == messages[-2:]


def test_messages_carry_compact_handles_that_the_next_agent_reuses(kv: Any) -> None:
    llm = KvbatonChatModel(client=kv, max_tokens=2)
    sizes = []
    for notes in (NOTES, NOTES * 12):  # a short and a ~12x longer context
        first = llm.invoke([SystemMessage("You are terse."), HumanMessage(notes + "Who shipped the parser?")])
        ref = first.additional_kwargs[KVBATON_KEY]
        assert "lineage" not in ref["handle"] and ref["handle"]["num_tokens"] > 0
        sizes.append(len(json.dumps(ref)))
        # the next agent's prompt contains that message: its KV is reused through the compact reference
        second = llm.invoke([SystemMessage("You are terse."), HumanMessage(notes + "Who shipped the parser?"), first,
                             HumanMessage("And the docs?")])
        assert second.usage_metadata["input_token_details"]["cache_read"] >= ref["handle"]["num_tokens"] - 2
    assert abs(sizes[0] - sizes[1]) <= 8 and max(sizes) < 1024  # bounded, whatever the context


def test_chat_model_from_kvbaton_url_or_base_url(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbaton.errors import ModelNotFound

    monkeypatch.setenv("KVBATON_URL", server.url)
    llm = KvbatonChatModel(max_tokens=2)  # like ChatOpenAI reading OPENAI_BASE_URL
    try:
        assert llm.client.base_url == server.url and llm.model_name == MODEL
        assert KvbatonChatModel(base_url=f"{server.url}/v1", model=MODEL).client is llm.client  # one connection
        reply = llm.invoke([HumanMessage("Say hi.")])
        assert reply.response_metadata["model_name"] == MODEL
        llm.client.release(reply.additional_kwargs[KVBATON_KEY]["handle"]["id"])  # the server is shared
        with pytest.raises(ModelNotFound, match="serves"):  # building does no I/O: checked on first use
            KvbatonChatModel(base_url=server.url, model="another-model").invoke([HumanMessage("Say hi.")])
    finally:
        connections.register_connection(None, server.url)
        llm.client.close()
