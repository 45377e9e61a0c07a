"""Events and the dashboard: the engine's event ring, the events of a wrapped LangGraph run, the
events API and the dashboard page under auth, the offline page, and (where Chromium is installed)
the live page in a headless browser showing every agent of a run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import threading
from typing import Annotated, Any, TypedDict

import pytest
from kvbaton import Event, Events, InvalidRequest
from kvbaton.backend.events import EventRing
from kvbaton.backend.server.dashboard import offline_page, read_events
from server_fixtures import TOKEN_A, TOKEN_B, ServerProcess

CHROMIUM = "/usr/bin/chromium"

try:
    from langgraph.graph import add_messages
except ImportError:  # the LangGraph test skips
    add_messages = None


class Chat(TypedDict):
    messages: Annotated[list, add_messages]


# -- the ring (no model) -----------------------------------------------------------------------------


@pytest.mark.unit
def test_the_ring_pages_by_sequence_number_and_counts_what_it_lost() -> None:
    ring = EventRing(capacity=3)
    assert ring.since(0) == Events(events=[], next=0, dropped=0, capacity=3)
    for i in range(5):
        ring.emit("request", agent=f"a{i}")
    page = ring.since(0)
    assert [e.seq for e in page.events] == [3, 4, 5] and page.next == 5
    assert page.dropped == 2  # events 1 and 2 fell out of the bounded ring before anyone read them
    assert ring.since(4).events[0].agent == "a4" and ring.since(4).dropped == 0
    assert ring.since(5) == Events(events=[], next=5, dropped=0, capacity=3)
    assert [e.seq for e in ring.since(2, limit=1).events] == [3]
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidRequest):
            ring.since(bad)  # type: ignore[arg-type]


@pytest.mark.unit
def test_concurrent_emitters_get_distinct_increasing_numbers() -> None:
    ring = EventRing(capacity=10_000)
    threads = [threading.Thread(target=lambda: [ring.emit("request") for _ in range(500)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [e.seq for e in ring.since(0).events]
    assert seqs == list(range(1, 2001))


@pytest.mark.unit
def test_the_offline_page_embeds_its_events_and_loads_nothing_from_elsewhere(tmp_path) -> None:
    events = [Event(seq=1, kind="request", time=2.0, agent="planner</script>", t_queued=1.0, t_admitted=1.1,
                    t_first_token=1.5, t_done=2.0, tokens_prefilled=10, tokens_generated=3)]
    saved = tmp_path / "events.json"
    saved.write_text(Events(events=events, next=1).model_dump_json())
    assert read_events(saved) == events
    lines = tmp_path / "events.jsonl"
    lines.write_text("\n".join(e.model_dump_json() for e in events))
    assert read_events(lines) == events
    page = offline_page(events, title="run")
    data = re.search(r'<script id="kvbaton-data" type="application/json">(.*?)</script>', page, re.S)
    assert data is not None and json.loads(data.group(1))["events"][0]["agent"] == "planner</script>"
    assert "src=" not in page and "http://" not in page and "https://" not in page  # self-contained
    for bad in ("not json at all {", '{"events": [{"seq": "x"}]}', '"just a string"'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(InvalidRequest):
            read_events(tmp_path / "bad.json")


@pytest.mark.unit
def test_kvbaton_dashboard_writes_the_offline_page(tmp_path) -> None:
    from kvbaton.cli import main

    saved = tmp_path / "events.json"
    saved.write_text(Events(events=[Event(seq=1, kind="evict", time=1.0, blocks=2, tier="dropped")], next=1)
                     .model_dump_json())
    assert main(["dashboard", "--events", str(saved), "--out", str(tmp_path / "page.html")]) == 0
    assert '"kind": "evict"' in (tmp_path / "page.html").read_text()
    (tmp_path / "broken.json").write_text("[1, 2")
    assert main(["dashboard", "--events", str(tmp_path / "broken.json")]) == 2


# -- a wrapped LangGraph run (real model) ------------------------------------------------------------


def test_the_events_of_a_wrapped_langgraph_run_match_the_run(engine) -> None:
    pytest.importorskip("langgraph")
    import kvbaton
    from kvbaton.adapters.langgraph import KVBATON_KEY, KvbatonChatModel, wrap
    from kvbaton.embedded import EmbeddedClient
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langgraph.graph import END, START, StateGraph

    client = EmbeddedClient(engine=engine)
    try:
        model = KvbatonChatModel(client=client, max_tokens=4)

        def agent(name: str) -> Any:
            def node(state: Chat) -> dict[str, Any]:
                ask = HumanMessage(f"{name}: one word.")
                return {"messages": [ask, model.invoke([*state["messages"], ask])]}
            return node

        g = StateGraph(Chat)
        names = ["planner", "writer", "critic", "writer2"]
        for name in names:
            g.add_node(name, agent(name))
        g.add_edge(START, names[0])
        for a, b in zip(names, names[1:], strict=False):
            g.add_edge(a, b)
        g.add_edge(names[-1], END)
        since = client.events().next
        out = wrap(g.compile(), client).invoke(
            {"messages": [SystemMessage("You are a small team."), HumanMessage("Name a color.")]})
        ai = [m for m in out["messages"] if isinstance(m, AIMessage)]
        calls = [e for e in client.events(since).events if e.kind == "request" and e.op == "generate"]
        assert len(calls) == len(ai) == len(names)  # one event per LLM call
        for event, message in zip(calls, ai, strict=True):
            meta = message.additional_kwargs[KVBATON_KEY]
            assert event.agent == meta["agent"]
            assert event.handle_out == kvbaton.Handle.model_validate(meta["handle"]).id
            usage = message.usage_metadata
            assert event.tokens_reused + event.tokens_prefilled == usage["input_tokens"]  # the whole prompt
            assert event.tokens_reused == usage["input_token_details"]["cache_read"]
            assert event.tokens_generated == usage["output_tokens"]
            assert event.t_queued <= event.t_admitted <= event.t_first_token <= event.t_done
        assert [e.agent for e in calls] == names
        assert all(e.tokens_reused > 0 for e in calls[1:])  # each agent went on from the one before
        assert [e.handle_in for e in calls[1:]] == [e.handle_out for e in calls[:-1]]
    finally:
        client.close()


# -- eviction events (real model) --------------------------------------------------------------------


def test_an_eviction_says_which_agents_blocks_went_and_their_steps_to_execution() -> None:
    from kvbaton.backend import Engine

    engine = Engine(kv_budget="20MiB", tiers=["host:64MiB"])  # 27 blocks of 16 tokens: the cache must evict
    try:
        fixed = "You are the archivist. " * 40
        engine.register_agent("archivist", fixed, prefill=True)
        engine.hints({"archivist": 5, "other": 0})
        since = engine.events().next
        for i in range(6):  # unrelated long prompts push the archivist's cached prompt out of the pool
            engine.release(engine.materialize(f"Filler {i}. " + "lorem ipsum dolor " * 60, agent="other"))
        evictions = [e for e in engine.events(since).events if e.kind == "evict"]
        assert evictions, "the pool is small enough that the cache had to evict"
        assert all(e.tier == "host" and e.policy == "ste" and e.blocks > 0 for e in evictions)
        assert any(e.steps_to_execution.get("archivist") == 5 for e in evictions)
    finally:
        engine.close()


# -- over HTTP: the events API and the page, under auth ------------------------------------------------


def test_events_are_behind_the_token_and_scoped_to_the_tenant(secure_server) -> None:
    with secure_server.http() as a, secure_server.http(token=TOKEN_B) as b, secure_server.http(token="") as anon:
        anon.headers.pop("Authorization", None)
        for path in ("/v1/kv/events", "/v1/kv/events/stream", "/v1/kv/stats"):
            response = anon.get(path)
            assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"
        since = a.get("/v1/kv/events").json()["next"]  # each tenant's events are numbered in its own sequence
        b_since = b.get("/v1/kv/events").json()["next"]
        for client, agent in ((a, "alice"), (b, "bob")):
            r = client.post("/v1/kv/generate", json={"messages": [{"role": "user", "content": "Hi"}], "agent": agent,
                                                     "max_tokens": 2})
            assert r.status_code == 200, r.text
            client.post("/v1/kv/release", json={"handles": [r.json()["handle"]["id"]]})
        mine = a.get("/v1/kv/events", params={"since": since}).json()
        theirs = b.get("/v1/kv/events", params={"since": b_since}).json()
        assert [e["agent"] for e in mine["events"] if e["kind"] == "request"] == ["alice"]
        assert [e["agent"] for e in theirs["events"] if e["kind"] == "request"] == ["bob"]
        assert mine["events"][0]["tenant"] and mine["events"][0]["tenant"] != theirs["events"][0]["tenant"]
        for path in ("/v1/kv/events", "/v1/kv/events/stream"):  # bad input fails before any stream starts
            bad = a.get(path, params={"since": -1})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        with a.stream("GET", "/v1/kv/events/stream", params={"since": since}) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.iter_lines()
            first = [next(lines) for _ in range(3)]
        assert first[0].startswith("id: ") and first[1] == "event: event"
        assert json.loads(first[2].removeprefix("data: "))["agent"] == "alice"
        # Per-agent counters, labelled by the salted tenant id, never the token; a tenant's own agents only.
        metrics, theirs_metrics = a.get("/metrics").text, b.get("/metrics").text
        assert re.search(r'kvbaton_agent_requests_total\{agent="alice",tenant="t-[0-9a-f]+"\} [1-9]', metrics)
        assert re.search(r'kvbaton_agent_prompt_tokens_total\{agent="bob",source="prefilled",tenant="t-[0-9a-f]+"\}',
                         theirs_metrics)
        assert 'agent="bob"' not in metrics and 'agent="alice"' not in theirs_metrics
        assert TOKEN_A not in metrics + theirs_metrics and TOKEN_B not in metrics + theirs_metrics


def _event_ids(http, headers: dict[str, str], params: dict[str, int] | None, count: int) -> list[int]:
    """The ids of the first ``count`` events an event stream sends."""
    ids: list[int] = []
    with http.stream("GET", "/v1/kv/events/stream", headers=headers, params=params) as stream:
        for line in stream.iter_lines():
            if line.startswith("id: "):
                ids.append(int(line.removeprefix("id: ")))
                if len(ids) == count:
                    break
    return ids


def test_a_reconnecting_event_source_gets_no_event_twice(secure_server) -> None:
    """A browser's EventSource sends the last id it got as ``Last-Event-ID`` when it reconnects: the
    stream goes on after it (a ``since`` in the query, when given, wins)."""
    with secure_server.http() as a:
        since = a.get("/v1/kv/events").json()["next"]
        for _ in range(2):
            r = a.post("/v1/kv/generate", json={"messages": [{"role": "user", "content": "Hi"}], "agent": "eve",
                                                "max_tokens": 2})
            a.post("/v1/kv/release", json={"handles": [r.json()["handle"]["id"]]})
        first = _event_ids(a, {}, {"since": since}, 2)
        again = _event_ids(a, {"Last-Event-ID": str(first[0])}, None, 1)  # reconnected after the first event
        assert again == first[1:2] and again[0] > first[0]
        assert _event_ids(a, {"Last-Event-ID": str(first[0])}, {"since": since}, 1) == first[:1]  # the query wins
        bad = a.get("/v1/kv/events/stream", headers={"Last-Event-ID": "not-an-id"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"


def test_the_page_loads_without_the_token_but_holds_no_data(secure_server) -> None:
    with secure_server.http(token="") as anon:
        anon.headers.pop("Authorization", None)
        page = anon.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert '<script src="/dashboard/dashboard.js"></script>' in page.text and "kvbaton-data" not in page.text
        script = anon.get("/dashboard/dashboard.js")
        assert script.status_code == 200 and "/v1/kv/events" in script.text
        assert anon.post("/dashboard").status_code == 401  # only reading the page is open


# -- the page in a browser ----------------------------------------------------------------------------


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}", *args],
            capture_output=True, text=True, timeout=120,
        )


@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="needs Debian's chromium package at /usr/bin/chromium")
def test_the_live_page_draws_every_agent_and_states_its_numbers_in_words() -> None:
    import kvbaton

    # Its own server: a pool of ~27 blocks over a host tier, so that the cache evicts hinted agents'
    # registered prompts to the tier and loads them back, and the page has every panel to draw.
    server = ServerProcess(["--kv-budget", "20MiB", "--tier", "host:64MiB", "--token", TOKEN_A], token=TOKEN_A).start()
    agents = ["scout", "analyst", "judge"]
    try:
        client = kvbaton.connect(server.url, token=TOKEN_A)
        client.hints({"scout": 0, "analyst": 1, "judge": 2})  # every agent hinted before anything is cached
        prompts = {agent: f"You are the {agent} of the review team. " * 8 for agent in agents}
        for agent in agents:
            client.register_agent(agent, prompts[agent], prefill=True)
        for i in range(6):  # unrelated long prompts push the registered prompts out to the host tier
            client.release(client.materialize(f"Filler {i}. " + "lorem ipsum dolor " * 60, agent="filler"))
        for agent in agents:  # each agent's turn finds its prompt in the tier
            client.hints({"scout": 2, "analyst": 1, "judge": 0, agent: 0}, running=[agent])
            client.release(client.complete(prompts[agent] + "Say one word.", max_tokens=2, agent=agent).handle)
        # The token travels in the URL fragment: browsers never send it to the server in the URL.
        done = _chromium("--virtual-time-budget=4000", "--dump-dom", f"{server.url}/dashboard#token={TOKEN_A}")
        client.close()
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert "this server needs its token" not in dom
    lanes = set(re.findall(r'<text x="6" y="[\d.]+" data-lane="([^"]+)"', dom))
    assert {*agents, "cache"} <= lanes, (lanes, dom[-3000:])
    assert '{"' not in dom and "&quot;" not in dom, "no raw JSON anywhere on the page"
    # evictions name the hinted owners of the blocks they moved, with their steps-to-execution in words
    evictions = re.findall(r'<rect class="evict"[^>]*><title>([^<]*)</title>', dom)
    assert evictions and all(re.fullmatch(r"evicted [\d,]+ blocks to host \(policy ste\); .+", t) for t in evictions)
    assert any(re.search(r"owners .*\b(scout|analyst|judge) \((running|STE \d+)\)", t) for t in evictions), evictions
    # every tier row has its capacity, in blocks and bytes
    assert re.search(r'<tr data-tier="device"><td>device</td><td>[\d,]+ / [\d,]+</td><td>[\d.]+ MiB / [\d.]+ MiB</td>'
                     r'<td>\d+ %</td></tr>', dom)
    assert re.search(r'<tr data-tier="host"><td>host</td><td>[\d,]+ / [\d,]+</td><td>[\d.]+ MiB / 6\d\.\d MiB</td>'
                     r'<td>\d+ %</td></tr>', dom), dom[-3000:]
    # where reused blocks were found, in words (device or host: prefetch may bring a prompt back first)
    assert re.search(r"cache hits \(blocks\): (device|host) [\d,]+(, (device|host) [\d,]+)?<", dom)
    # the per-agent table: counts, TTFT in seconds, the reuse share in percent
    for agent in agents:
        assert re.search(rf'<tr data-agent="{agent}"><td>{agent}</td><td>[\d,]+</td><td>\d+\.\d{{3}}</td>'
                         r'(<td>[\d,]+</td>){3}<td>\d+ %</td>', dom), agent
    assert len(re.findall(r'class="axis tick"', dom)) >= 3, "the reuse chart has a time axis"


# -- per-agent metrics (no model) ----------------------------------------------------------------------


@pytest.mark.unit
def test_agent_metrics_carry_tenant_and_agent_labels_capped_at_the_first_n_agents() -> None:
    from kvbaton.backend.server.metrics import AgentCollector
    from prometheus_client import CollectorRegistry, generate_latest

    ring = EventRing(capacity=16)
    registry = CollectorRegistry()
    registry.register(AgentCollector(ring.since, lambda name: tuple(name.split("/", 1)), max_agents=2))

    def request(agent: str, **tokens: int) -> None:
        ring.emit("request", agent=agent, finish="stop", **tokens)

    request("t1/planner", tokens_reused=30, tokens_approximate=10, tokens_prefilled=5, tokens_generated=4,
            prefetch_hits=2, blocks_loaded={"device": 1, "host": 3})
    request("t2/planner", tokens_prefilled=7)
    request("t1/writer", tokens_prefilled=9)  # a third agent: over the cap
    request("t1/planner", tokens_prefilled=1)
    ring.emit("request", agent="t1/planner", finish="error", tokens_prefilled=100)  # failed: not counted
    text = generate_latest(registry).decode()
    assert 'kvbaton_agent_requests_total{agent="planner",tenant="t1"} 2.0' in text
    assert 'kvbaton_agent_requests_total{agent="planner",tenant="t2"} 1.0' in text
    assert 'kvbaton_agent_requests_total{agent="other",tenant="t1"} 1.0' in text and "writer" not in text
    assert 'kvbaton_agent_prompt_tokens_total{agent="planner",source="reused",tenant="t1"} 20.0' in text
    assert 'kvbaton_agent_prompt_tokens_total{agent="planner",source="approximate",tenant="t1"} 10.0' in text
    assert 'kvbaton_agent_prompt_tokens_total{agent="planner",source="prefilled",tenant="t1"} 6.0' in text
    assert 'kvbaton_agent_prefetch_blocks_total{agent="planner",outcome="hit",tenant="t1"} 2.0' in text
    assert 'kvbaton_agent_prefetch_blocks_total{agent="planner",outcome="miss",tenant="t1"} 3.0' in text
    for i in range(20):  # more than the ring holds between two scrapes: the loss is counted, not hidden
        request("t1/planner")
    text = generate_latest(registry).decode()
    assert "kvbaton_events_dropped_total 4.0" in text  # events 6..9 fell out
    assert 'kvbaton_agent_requests_total{agent="planner",tenant="t1"} 18.0' in text


def test_a_request_event_says_whether_the_step_graph_predicted_its_agent(engine) -> None:
    from kvbaton import SamplingParams, StepGraph

    graph = StepGraph()
    graph.add_edge("a", "b")
    graph.add_edge("b", "c")
    since = engine.events().next
    for agent in ("a", "b", "c"):
        engine.hints(graph, running=[agent])
        engine.release(engine.complete(f"{agent} says", SamplingParams(max_tokens=1), agent=agent).handle)
    engine.hints({"c": 0, "a": 0})  # 'a' was not due (c had just run): the graph did not predict it
    engine.release(engine.complete("again", SamplingParams(max_tokens=1), agent="a").handle)
    engine.release(engine.complete("nobody", SamplingParams(max_tokens=1)).handle)
    got = [(e.agent, e.ste_predicted) for e in engine.events(since).events if e.kind == "request"]
    assert got == [("a", None), ("b", 1.0), ("c", 1.0), ("a", None), (None, None)]


def test_a_failed_request_is_an_error_event_and_its_error_stays_the_callers(engine) -> None:
    since = engine.events().next
    with pytest.raises(InvalidRequest):
        engine.materialize("hello", agent=["not", "a", "name"])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        engine.materialize("hello", agent="x" * 300)
    stream = engine.generate_stream([{"role": "user", "content": "Hi"}], agent="quitter")
    stream.close()  # abandoned before its first token: everything given back
    got = [(e.op, e.agent, e.finish, e.handle_out) for e in engine.events(since).events]
    assert got == [("materialize", None, "error", None), ("materialize", "x" * 300, "error", None),
                   ("generate", "quitter", "abandoned", None)]
    assert engine.stats().handles_live == 0
