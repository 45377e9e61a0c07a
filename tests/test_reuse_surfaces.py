"""Cross-prefix reuse on the server's surfaces: ``kvbaton serve --reuse`` / ``--shared-spans``, the
native ``reuse`` field, the OpenAI routes' ``kvbaton.reuse`` and how their answers are marked
(``kvbaton.exact``, ``X-Kvbaton-Approximate``, ``cached_tokens`` = exact reuse only), and tenants'
spans kept apart. Real ``kvbaton serve`` processes on loopback (the session's ``server`` and
``secure_server``, plus one ``--reuse auto --shared-spans`` server of this module), a ~250-token
document, greedy, a few tokens per answer.

Whether ``auto`` approximates or falls back to dense prefill depends on the next-token margin, so
the marking checks use ``rotate`` (never falls back); ``auto`` is checked to have found the span.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import kvbaton
import pytest
from conftest import dense_greedy
from kvbaton.bench.corpus import document
from server_fixtures import TOKEN_A, TOKEN_B, ServerProcess, _ready, running

DOC = document(160, seed=3)  # ~230 tokens of meeting notes
OUTCOMES = {"exact", "rotated", "corrected", "blended", "recomputed"}
APPROXIMATE = "x-kvbaton-approximate"


def chat(system: str, *more: dict[str, str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": DOC}, *more]


def auto_server() -> ServerProcess:
    """Two tenants, ``--reuse auto`` (the default policy) and ``--shared-spans``."""
    return ServerProcess(
        ["--kv-budget", "64MiB", "--max-tokens", "8", "--default-max-tokens", "4", "--reuse", "auto",
         "--shared-spans", "--token", TOKEN_A, "--token", TOKEN_B],
        token=TOKEN_A,
    )


@pytest.fixture(scope="module")
def servers(server_processes: dict[str, ServerProcess]) -> Iterator[dict[str, ServerProcess]]:
    """This module's server started alongside the session's (their start-ups overlap)."""
    with running({"auto": auto_server()}) as mine:
        procs = {"server": _ready(server_processes, "server"),
                 "secure": _ready(server_processes, "secure_server")}
        mine["auto"].wait_healthy()
        yield {**procs, **mine}


class Tenant:
    """One tenant's calls to one server; releases every handle it made at the end."""

    def __init__(self, proc: ServerProcess, token: str | None = None) -> None:
        self.http = proc.http(token=token)
        self.made: list[str] = []

    def native(self, messages: list[dict[str, str]], **body: Any) -> dict[str, Any]:
        r = self.http.post("/v1/kv/generate", json={"messages": messages, "max_tokens": 4, **body})
        assert r.status_code == 200, r.text
        out = r.json()
        self.made.append(out["handle"]["id"])
        return out

    def openai(self, messages: list[dict[str, str]], agent: str | None = None, **body: Any) -> httpx.Response:
        headers = {"X-Kvbaton-Agent": agent} if agent else {}
        r = self.http.post("/v1/chat/completions", headers=headers,
                           json={"messages": messages, "max_tokens": 4, **body})
        assert r.status_code == 200, r.text
        self.made.extend(h for h in r.json()["kvbaton"]["handles"] if h)
        return r

    def close(self) -> None:
        for hid in dict.fromkeys(self.made):
            self.http.post("/v1/kv/release", json={"handles": [hid]})  # already released ones: fine
        self.http.close()


@pytest.fixture
def tenants() -> Iterator[list[Tenant]]:
    made: list[Tenant] = []
    yield made
    for t in made:
        t.close()


def open_tenant(tenants: list[Tenant], proc: ServerProcess, token: str | None = None) -> Tenant:
    t = Tenant(proc, token)
    tenants.append(t)
    return t


def check_marking(result: dict[str, Any]) -> None:
    """A result's marks agree with each other."""
    segments, timings = result["segments"], result["timings"]
    assert all(s["outcome"] in OUTCOMES for s in segments)
    if not all(s["exact"] for s in segments):
        assert not result["exact"]
    assert (timings["tokens_approximate"] > 0) == (not result["exact"])
    assert timings["tokens_approximate"] <= timings["tokens_reused"]


# -- the native route ---------------------------------------------------------------------------------


def test_native_auto_places_the_readers_document_and_exact_matches_dense(servers, tenants, reference):
    t = open_tenant(tenants, servers["server"])
    reader = t.native(chat("You are the reader. Summarize the notes."), agent="native-reader")
    assert reader["exact"] and reader["segments"] == []

    reviewer = chat("You are the reviewer. List the risks in the notes.")
    auto = t.native(reviewer, agent="native-reviewer", reuse="auto")
    check_marking(auto)
    assert auto["segments"], "auto found no span of the reader's document"
    seg = auto["segments"][0]
    assert seg["source"] == reader["handle"]["id"] and seg["end"] - seg["start"] > 150
    # Either the span's K/V were placed (re-aligned, partly recomputed), or the confidence gate
    # recomputed it densely and says why.
    assert auto["timings"]["tokens_reused"] > 0 or (seg["outcome"] == "recomputed" and seg["reason"])

    exact = t.native(reviewer, agent="native-reviewer", reuse="exact")
    assert exact["exact"] and exact["segments"] == [] and exact["timings"]["tokens_approximate"] == 0
    prompt = t.http.post("/v1/kv/chat_tokens", json={"messages": reviewer}).json()["token_ids"]
    dense, _ = dense_greedy(reference, prompt, 4)
    assert exact["token_ids"] == dense[: len(exact["token_ids"])]

    # The header names the policy when the body does not; a bad one is a 400.
    r = t.http.post("/v1/kv/generate", headers={"X-Kvbaton-Reuse": "rotate"},
                    json={"messages": chat("You are the editor."), "max_tokens": 2})
    assert r.status_code == 200
    rotated = r.json()
    t.made.append(rotated["handle"]["id"])
    assert not rotated["exact"] and rotated["segments"][0]["outcome"] == "rotated"
    r = t.http.post("/v1/kv/generate", headers={"X-Kvbaton-Reuse": "sometimes"},
                    json={"messages": chat("You are the editor."), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


# -- the OpenAI routes ----------------------------------------------------------------------------------


def test_openai_default_is_exact_rotate_is_marked_and_a_resumed_approximate_turn_too(servers, tenants):
    t = open_tenant(tenants, servers["server"])
    r = t.openai(chat("You are the planner. Plan the next steps."), agent="oa-planner")
    ext = r.json()["kvbaton"]
    assert APPROXIMATE not in r.headers
    assert ext["exact"] and ext["reuse"] == "exact" and ext["tokens_approximate"] == 0 and ext["segments"] == []

    r = t.openai(chat("You are the critic. Point out what is missing."), agent="oa-critic")
    # the default: exact, although the planner's document is live
    assert APPROXIMATE not in r.headers and r.json()["kvbaton"]["exact"] and r.json()["kvbaton"]["segments"] == []

    critic = chat("You are the second critic. Point out what is wrong.")  # (not in the prefix cache)
    r = t.openai(critic, agent="oa-critic-2", kvbaton={"reuse": "rotate"})
    body, ext = r.json(), r.json()["kvbaton"]
    assert r.headers[APPROXIMATE] == "true"
    assert not ext["exact"] and ext["reuse"] == "rotate" and ext["segments"][0]["outcome"] == "rotated"
    timings = ext["timings"][0]
    assert ext["tokens_approximate"] == timings["tokens_approximate"] > 0
    usage = body["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == timings["tokens_reused"] - timings["tokens_approximate"]
    assert usage["prompt_tokens"] == timings["tokens_reused"] + timings["tokens_prefilled"]

    # The agent's next turn resumes its retained (approximate) handle: marked as well.
    turn = [*critic, {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Anything else?"}]
    r = t.openai(turn, agent="oa-critic-2", kvbaton={"reuse": "rotate"})
    ext = r.json()["kvbaton"]
    assert r.headers[APPROXIMATE] == "true" and not ext["exact"] and ext["tokens_approximate"] > 0
    timings = ext["timings"][0]
    assert timings["tokens_reused"] > ext["tokens_approximate"] > 0  # the resumed handle's whole prompt
    assert (r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            == timings["tokens_reused"] - timings["tokens_approximate"])
    # An exact request of the same agent does not resume that approximate handle.
    r = t.openai(turn, agent="oa-critic-2")
    assert APPROXIMATE not in r.headers and r.json()["kvbaton"]["exact"]
    assert r.json()["kvbaton"]["timings"][0]["tokens_approximate"] == 0


def test_openai_stream_and_completions_are_marked(servers, tenants):
    t = open_tenant(tenants, servers["server"])
    t.openai(chat("You are the scribe. Write the minutes."), agent="st-scribe")
    body = {"messages": chat("You are the auditor. Check the numbers."), "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}, "kvbaton": {"reuse": "rotate"}}
    with t.http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Kvbaton-Agent": "st-auditor"}) as r:
        assert r.status_code == 200
        assert r.headers[APPROXIMATE] == "true"  # the prompt is computed before the stream answers
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    marked = [e["kvbaton"] for e in events if "kvbaton" in e]
    assert marked and all(not m["exact"] and m["tokens_approximate"] > 0 for m in marked)
    t.made.extend(h for h in marked[0]["handles"] if h)
    usage = next(e["usage"] for e in events if e.get("usage"))
    timings = marked[0]["timings"][0]
    assert usage["prompt_tokens_details"]["cached_tokens"] == timings["tokens_reused"] - timings["tokens_approximate"]

    r = t.http.post("/v1/completions", json={"prompt": "Notes to audit:\n" + DOC, "max_tokens": 2,
                                             "kvbaton": {"reuse": "rotate"}})
    assert r.status_code == 200 and r.headers[APPROXIMATE] == "true" and not r.json()["kvbaton"]["exact"]
    r = t.http.post("/v1/completions", json={"prompt": "Notes to audit:\n" + DOC, "max_tokens": 2})
    assert r.status_code == 200 and APPROXIMATE not in r.headers and r.json()["kvbaton"]["exact"]
    assert r.json()["kvbaton"]["reuse"] == "exact"

    metrics = t.http.get("/metrics").text
    assert 'kvbaton_prompt_tokens_total{endpoint="/v1/chat/completions",source="approximate"}' in metrics


def test_streamed_chat_openai_replies_are_marked_on_every_surface(servers, tenants, monkeypatch):
    """Issue 40: a streamed reply is marked as a whole one is: the response header, the stream's last chunk,
    and LangChain's ``response_metadata`` through the ChatOpenAI drop-in (``wrap(app)``, mode 2)."""
    openai = pytest.importorskip("openai")
    langchain_openai = pytest.importorskip("langchain_openai")
    from kvbaton.adapters.langgraph import wrap
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langgraph_apps import chain as graph_chain
    from typing_extensions import TypedDict

    proc = servers["server"]
    t = open_tenant(tenants, proc)
    t.openai(chat("You are the reader. Summarize the notes."), agent="sm-reader")
    client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct", messages=chat("You are the streaming critic."), max_tokens=3, stream=True,
        extra_headers={"X-Kvbaton-Agent": "sm-critic", "X-Kvbaton-Reuse": "rotate"})
    assert raw.headers[APPROXIMATE] == "true"
    chunks = list(raw.parse())
    marked = [c.model_extra["kvbaton"] for c in chunks if (c.model_extra or {}).get("kvbaton")]
    assert len(marked) == 1 and not marked[0]["exact"] and marked[0]["tokens_approximate"] > 0
    t.made.extend(h for h in marked[0]["handles"] if h)

    class State(TypedDict):
        messages: list[Any]

    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    llm = langchain_openai.ChatOpenAI(model="smollm2-135m-instruct", base_url=f"{proc.url}/v1", api_key="unused",
                                      streaming=True,
                                      max_tokens=3, temperature=0, max_retries=0, timeout=120)

    def node(role: str) -> Any:
        def fn(state: State) -> dict[str, Any]:
            reply = llm.invoke([SystemMessage(f"You are the streaming {role}. Be brief."), HumanMessage(DOC)])
            return {"messages": [*state["messages"], reply]}

        return fn

    app = wrap(graph_chain(State, {"reader": node("reader"), "reviewer": node("reviewer")}).compile(),
               base_url=proc.url, reuse="rotate")
    replies = [m for m in app.invoke({"messages": []})["messages"] if isinstance(m, AIMessage)]
    # the run's first agent reads densely (its session holds nothing yet); the second places its document
    assert [m.response_metadata["kvbaton"]["exact"] for m in replies] == [True, False]


def test_sessions_keep_approximate_reuse_to_their_own_run(servers, tenants):
    """Issue 40: a request that names its session (a workflow run: X-Kvbaton-Session, kvbaton.session, the
    OpenAI user) places only spans its own session computed; a fresh run's first agent reads densely."""
    t = open_tenant(tenants, servers["server"])

    def ask(system: str, agent: str, session: str) -> dict[str, Any]:
        r = t.http.post("/v1/chat/completions", headers={"X-Kvbaton-Agent": agent, "X-Kvbaton-Session": session},
                        json={"messages": chat(system), "max_tokens": 2, "kvbaton": {"reuse": "rotate"}})
        assert r.status_code == 200, r.text
        ext = r.json()["kvbaton"]
        t.made.extend(h for h in ext["handles"] if h)
        return ext

    reader = ask("You are the session reader.", "ss-reader", "run-a")
    fresh = ask("You are the session reviewer.", "ss-reviewer", "run-b")
    assert fresh["segments"] == [] and fresh["exact"]  # another run's document shapes nothing
    same = ask("You are the session critic.", "ss-critic", "run-a")
    assert same["segments"] and same["segments"][0]["source"] == reader["handle"] and not same["exact"]
    native = t.http.post("/v1/kv/generate", headers={"X-Kvbaton-Session": "run-c"},
                         json={"messages": chat("You are the session editor."), "max_tokens": 2, "reuse": "rotate"})
    assert native.status_code == 200 and native.json()["segments"] == []
    t.made.append(native.json()["handle"]["id"])


# -- the server's flags and tenants ---------------------------------------------------------------------


def test_server_reuse_flag_is_the_default_and_shared_spans_cross_tenants(servers, tenants):
    a = open_tenant(tenants, servers["auto"], TOKEN_A)
    b = open_tenant(tenants, servers["auto"], TOKEN_B)
    a.native(chat("You are the reader. Summarize the notes."), agent="reader")
    auto = a.native(chat("You are the reviewer. List the risks."), agent="reviewer")  # no reuse field: auto
    check_marking(auto)
    assert auto["segments"]
    r = a.openai(chat("You are the planner. Plan the week."), agent="planner")
    assert r.json()["kvbaton"]["reuse"] == "auto" and r.json()["kvbaton"]["segments"]
    assert a.native(chat("You are the scribe."), agent="scribe", reuse="exact")["segments"] == []
    # --shared-spans: tenant B places tenant A's spans.
    crossed = b.native(chat("You are the outsider. Judge the notes."), agent="outsider", reuse="rotate")
    assert crossed["segments"] and not crossed["exact"]


def test_tenants_never_place_each_others_spans(servers, tenants):
    a = open_tenant(tenants, servers["secure"], TOKEN_A)
    b = open_tenant(tenants, servers["secure"], TOKEN_B)
    reader = a.native(chat("You are the reader of tenant A."), agent="reader", reuse="rotate")
    other = b.native(chat("You are the reviewer of tenant B."), agent="reviewer", reuse="rotate")
    assert other["segments"] == [] and other["exact"] and other["timings"]["tokens_approximate"] == 0
    own = a.native(chat("You are the reviewer of tenant A."), agent="reviewer", reuse="rotate")
    assert own["segments"] and own["segments"][0]["source"] == reader["handle"]["id"]
    # Agentless requests are their tenant's too (the engine names them "tenant/"): its own spans only.
    anon = b.native(chat("You are nobody in particular."), reuse="rotate")
    assert {s["source"] for s in anon["segments"]} <= {other["handle"]["id"]}
    # Tenant B's later requests place tenant B's own spans only, never tenant A's.
    r = b.openai(chat("You are the critic of tenant B."), agent="critic", kvbaton={"reuse": "rotate"})
    sources = {s["source"] for s in r.json()["kvbaton"]["segments"]}
    assert sources <= {other["handle"]["id"], anon["handle"]["id"]} and not sources & set(a.made)


# -- in process ---------------------------------------------------------------------------------------------


def test_multi_tenant_engine_without_span_partitions_serves_everything_exact(engine, monkeypatch):
    from kvbaton.backend.engine import Engine
    from kvbaton.backend.server.state import ServerState
    from kvbaton.backend.tenants import TenantPartition

    # As a Cluster: an engine that cannot keep tenants' spans apart.
    monkeypatch.setattr(Engine, "partitionable", property(lambda self: TenantPartition(prefix_cache=True)))
    state = ServerState(engine, tenants={"a": "ta", "b": "tb"}, max_tokens=None, default_max_tokens=8, max_n=1,
                        max_agents=4, threads=1, fallback_max_tokens=64, reuse="auto")
    assert not state.cross_prefix and state.reuse("rotate") == "exact" and state.reuse(None) == "exact"
    shared = ServerState(engine, tenants={"a": "ta", "b": "tb"}, max_tokens=None, default_max_tokens=8, max_n=1,
                         max_agents=4, threads=1, fallback_max_tokens=64, reuse="auto", shared_spans=True)
    assert shared.reuse(None) == "auto" and shared.reuse("exact") == "exact"


@pytest.mark.unit
def test_cli_flags_and_span_partitions():
    from kvbaton.backend.server.tenancy import AgentNames, tenant_map
    from kvbaton.backend.tenants import AgentRef, TenantPartition
    from kvbaton.cli import build_parser
    from kvbaton.errors import InvalidRequest

    args = build_parser().parse_args(["serve"])
    assert args.reuse == "exact" and not args.shared_spans
    args = build_parser().parse_args(["serve", "--reuse", "auto", "--shared-spans"])
    assert args.reuse == "auto" and args.shared_spans
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reuse", "sometimes"])

    names = AgentNames(multi_tenant=True)
    per_tenant = TenantPartition(spans=True)
    assert names.agent("t-1", "a/b") == AgentRef("t-1", "a/b") and names.agent("t-1", "a/b").label == "t-1/a/b"
    assert per_tenant.span_partition(names.agent("t-1", "a/b").tenant) == "t-1"
    # A request without a tenant (no agent, or a plain name) places no spans when they are per tenant.
    assert per_tenant.span_partition(AgentRef.of(None).tenant) is None
    assert per_tenant.span_partition(AgentRef.of("solo").tenant) is None
    assert TenantPartition().span_partition(None) == ""  # shared: every request, with a tenant or not
    # Agentless requests are their tenant's too: the engine can partition them; the tenant sees no agent.
    assert names.agent("t-1", None) == AgentRef("t-1") and AgentRef("t-1").label == "t-1/"
    assert names.own_name("t-1", "t-1/") == "" and names.own_name("t-2", "t-1/") is None
    assert names.own_name("t-1", "t-1/a/b") == "a/b" and AgentRef.parse("t-1/a/b") == AgentRef("t-1", "a/b")
    assert AgentNames(multi_tenant=False).agent("default", None) is None
    with pytest.raises(InvalidRequest, match="'/'"):
        tenant_map({"token": "team/a"})


def test_audit_stats_show_a_tenant_only_its_own_agents():
    from kvbaton.backend.server.state import ServerState

    engine = kvbaton.backend.Engine(kv_budget="384MiB", audit_fraction=1.0)  # every approximate answer checked
    try:
        state = ServerState(engine, tenants={"a": "ta", "b": "tb"}, max_tokens=None, default_max_tokens=8, max_n=1,
                            max_agents=4, threads=1, fallback_max_tokens=64)
        doc = document(120, seed=31)
        sampling = kvbaton.SamplingParams(max_tokens=2)
        messages = [{"role": "user", "content": doc + "\n\nSummary?"}]
        engine.generate([{"role": "system", "content": "You read."}, *messages], sampling=sampling,
                        agent=state.agent("ta", "reader"))
        result = engine.generate([{"role": "system", "content": "You review."}, *messages], sampling=sampling,
                                 agent=state.agent("ta", "reviewer"), reuse="rotate")
        assert not result.exact
        engine.audit.flush()
        assert set(state.stats("ta").audit.agents) == {"reviewer"}  # by its own name
        assert state.stats("tb").audit.agents == {} and state.stats("tb").audit.checked == 1  # totals: the engine's
    finally:
        engine.close()
