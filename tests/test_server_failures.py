"""The server's failure paths, each against a real ``kvbaton serve`` process on loopback (issue 20).

Specification:
- a streamed request the client drops (native, OpenAI chat and completions, n=1 and n=2) leaves
  nothing behind: after ``release_all`` of the tenant, live handles and pinned blocks are back at
  their baseline;
- every worker of a multi-device server dead: ``/health`` answers 503 "unhealthy" with a reason, and
  requests 503 ``server_unavailable`` with ``Retry-After`` (not 500);
- ``/v1/kv/stats`` shows a tenant only its own agents, without the tenant prefix; tenant ids are not
  an unsalted hash of the token;
- JSON nested deeper than the server's limit is a 400 naming the limit, and the connection stays usable;
- a request that can never fit the pool is a 400 saying so, not "retry later";
- per-tenant quotas on live handles, KV bytes and handle tokens answer 429 ``quota_exceeded``; idle handles expire
  after ``--handle-ttl``;
- a full pool never evicts another tenant's retained OpenAI handles.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import kvbaton
import pytest
from kvbaton.errors import HandleNotFound, QuotaExceeded, ServerUnavailable
from server_fixtures import TOKEN_A, TOKEN_B, ServerProcess, running

WAIT_S = 120.0  # how long a server may take to get somewhere (a busy 2-core machine), never a measured bound

# Two tenants, a 16-block pool (256 tokens), small quotas: never-fits, quotas, slot eviction. Handle
# tokens and KV bytes count the same tokens: the handle-token quota (960) sits just under the KV one
# (64 blocks, 1024 tokens), so that each can be the one a request passes.
TIGHT = ["--kv-budget", "16 blocks", "--block-size", "16", "--token", TOKEN_A, "--token", TOKEN_B,
         "--max-handles-per-tenant", "40", "--max-kv-bytes-per-tenant", "64 blocks",
         "--max-handle-tokens-per-tenant", "960", "--default-max-tokens", "2"]
TTL = ["--kv-budget", "32MiB", "--handle-ttl", "1"]
CLUSTER = ["--devices", "cpu,cpu", "--kv-budget", "48MiB"]


@pytest.fixture(scope="module")
def extra_servers() -> Iterator[dict[str, ServerProcess]]:
    """The module's own servers, started together (their start-up overlaps), stopped at the end."""
    with running({"tight": ServerProcess(TIGHT, token=TOKEN_A), "ttl": ServerProcess(TTL),
                  "cluster": ServerProcess(CLUSTER)}) as procs:
        yield procs


@pytest.fixture(scope="module")
def tight(extra_servers) -> ServerProcess:
    extra_servers["tight"].wait_healthy()
    return extra_servers["tight"]


def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait for the server to reach a state (polling; the assertion is on the state, not the time)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"server never got to: {what}"
        time.sleep(0.1)


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    body = response.json()
    assert set(body) >= {"error"} and {"code", "message"} <= set(body["error"]), body
    return response.status_code, body["error"]["code"], body["error"]["message"]


def finished(http: httpx.Client, endpoint: str) -> int:
    """Requests to ``endpoint`` the server has finished with, cleanup included (the metrics middleware
    counts a request once the app returned)."""
    text = http.get("/metrics").text
    found = re.search(rf'kvbaton_request_duration_seconds_count{{endpoint="{re.escape(endpoint)}"}} (\S+)', text)
    return int(float(found.group(1))) if found else 0


def release_all(server: ServerProcess, token: str | None = None) -> int:
    with server.http(token=token) as http:
        return int(http.post("/v1/kv/release_all").json()["released"])


def pinned(http: httpx.Client) -> tuple[int, int]:
    """Live handles and blocks pinned by anything but the prefix cache."""
    s = http.get("/v1/kv/stats").json()
    return s["handles_live"], s["blocks_used"] - s["blocks_cache_only"]


# -- 1. dropped streams ---------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "Count slowly from one to twenty."}], "max_tokens": 6}
COMPLETION = {"prompt": "One, two, three, four,", "max_tokens": 6}


def _drop_stream(http: httpx.Client, path: str, body: dict, last_choice: int) -> None:
    """Stream ``body`` and disconnect at the first piece of text of choice ``last_choice``: every
    choice before it has ended, so its handle exists."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if path == "/v1/kv/resume":
                return  # native: the first chunk
            choice = data["choices"][0] if data.get("choices") else {}
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if choice.get("index") == last_choice and text:
                return  # leaving the block closes the connection mid-stream


@pytest.mark.parametrize(("path", "n"), [("/v1/chat/completions", 1), ("/v1/chat/completions", 2),
                                       ("/v1/completions", 1), ("/v1/completions", 2), ("/v1/kv/resume", 1)])
def test_dropped_streams_leak_nothing(server, path, n):
    with server.http() as http:
        http.post("/v1/kv/release_all")
        base = pinned(http)
        if path == "/v1/kv/resume":
            handle = http.post("/v1/kv/materialize", json={"context": "Count slowly from one to twenty:"}).json()
            body: dict = {"handle": handle["id"], "suffix": " one", "max_tokens": 6, "ignore_eos": True}
        else:
            body = {**(CHAT if path == "/v1/chat/completions" else COMPLETION), "n": n, "ignore_eos": True}
        for _ in range(3):
            done = finished(http, path)
            _drop_stream(http, path, body, n - 1)
            until(lambda: finished(http, path) > done, f"{path} cleaned up after the disconnect")
        http.post("/v1/kv/release_all")
        assert pinned(http) == base


# -- 2. every worker dead ------------------------------------------------------------------------------


def test_health_and_requests_say_unavailable_when_every_worker_is_dead(extra_servers):
    cluster = extra_servers["cluster"]
    cluster.wait_healthy()
    with cluster.http() as http:
        assert http.get("/health").json()["status"] == "ok"
        workers = http.get("/v1/kv/stats").json()["cluster"]["workers"]
        assert len(workers) == 2 and all(w["pid"] for w in workers)
        for w in workers:
            os.kill(w["pid"], signal.SIGKILL)
        until(lambda: http.get("/health").status_code == 503, "/health reporting the dead workers")
        health = http.get("/health")
        assert health.json()["status"] == "unhealthy" and "worker" in health.json()["reason"]
        assert health.headers.get("retry-after")
        for method, path, body in [("POST", "/v1/kv/materialize", {"context": "anyone there?"}),
                                   ("POST", "/v1/kv/complete", {"prompt": "hello", "max_tokens": 2}),
                                   ("GET", "/v1/kv/stats", None)]:
            response = http.request(method, path, json=body)
            status, code, message = error_of(response)
            assert (status, code) == (503, "server_unavailable"), (path, message)
            assert "worker" in message and response.headers.get("retry-after")
    with kvbaton.connect(cluster.url) as client:
        with pytest.raises(ServerUnavailable):
            client.materialize("still nobody?")
        with pytest.raises(ServerUnavailable):
            client.health()
    # Clients retry the transient 503 (it says Retry-After), within their bounds: the openai client
    # every request, kvbaton's own only the idempotent operations (reads, releases...), never one
    # that makes handles.
    openai = pytest.importorskip("openai")
    sent = Counting()
    with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=2,
                       http_client=httpx.Client(transport=sent)) as oa, pytest.raises(openai.InternalServerError):
        oa.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert sent.paths == ["/v1/chat/completions"] * 3
    sent = Counting()
    with kvbaton.http.HttpClient(cluster.url, transport=sent, max_retries=2, max_retry_wait=10) as client:
        with pytest.raises(ServerUnavailable):
            client.stats()
        assert sent.paths == ["/v1/kv/stats"] * 3
        with pytest.raises(ServerUnavailable):
            client.materialize("not retried: it makes a handle")
        assert sent.paths[3:] == ["/v1/kv/materialize"]
    sent = Counting()
    with kvbaton.http.HttpClient(cluster.url, transport=sent, max_retries=5, max_retry_wait=1.5) as client:
        with pytest.raises(ServerUnavailable):
            client.stats()
        assert sent.paths == ["/v1/kv/stats"] * 2  # Retry-After 1 s: a second wait would pass 1.5 s in all


class Counting(httpx.HTTPTransport):
    """An httpx transport that remembers the path of every request it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return super().handle_request(request)


@pytest.mark.unit
@pytest.mark.parametrize(("module", "name"), [("kvbaton.backend.engine", "Engine"),
                                              ("kvbaton.backend.cluster.coordinator", "Cluster"),
                                              ("kvbaton.backend.sglang_plugin.engine", "SglangEngine")])
def test_every_engine_says_whether_it_can_serve(module, name):
    import importlib
    import inspect

    from kvbaton.ops import EngineOps

    cls = getattr(importlib.import_module(module), name)
    assert [p for p in inspect.signature(cls.healthy).parameters if p != "self"] == []
    assert "healthy" in vars(EngineOps)


# -- 3. stats of other tenants ---------------------------------------------------------------------------


def test_stats_show_a_tenant_only_its_own_agents(secure_server):
    with secure_server.http(token=TOKEN_A) as a, secure_server.http(token=TOKEN_B) as b:
        assert a.post("/v1/kv/hints", json={"steps": {"alpha": 1}}).status_code == 200
        assert b.post("/v1/kv/hints", json={"steps": {"beta-secret": 2}}).status_code == 200
        b.post("/v1/kv/complete", json={"prompt": "hi", "max_tokens": 1, "agent": "beta-secret"})
        mine = a.get("/v1/kv/stats")
        stats = mine.json()
        assert stats["cache"]["steps_to_execution"] == {"alpha": 1.0}
        assert "beta-secret" not in mine.text
        for token in (TOKEN_A, TOKEN_B):  # no unsalted token hash anywhere
            assert hashlib.sha256(token.encode()).hexdigest()[:16] not in mine.text
        assert not re.search(r"t-[0-9a-f]{16}/", mine.text)
        theirs = b.get("/v1/kv/stats").json()
        assert theirs["cache"]["steps_to_execution"] == {"beta-secret": 2.0}
        # (other tests of this session server may have used tenant B's agents too: B's own, never A's)
        assert "beta-secret" in theirs["agents"] and "alpha" not in theirs["agents"]
        a.post("/v1/kv/hints", json={"steps": {}})
        b.post("/v1/kv/hints", json={"steps": {}})
        b.post("/v1/kv/release_all")


@pytest.mark.unit
def test_tenant_ids_are_salted_per_process():
    from kvbaton.backend.server import tenant_id

    assert tenant_id("some-token") == tenant_id("some-token")
    assert tenant_id("some-token") != "t-" + hashlib.sha256(b"some-token").hexdigest()[:16]
    assert tenant_id("some-token", salt=b"one") != tenant_id("some-token", salt=b"two")


# -- 4. deeply nested JSON -----------------------------------------------------------------------------


def _nested(depth: int, leaf: str = '"x"') -> str:
    return "[" * depth + leaf + "]" * depth


def test_deeply_nested_json_is_a_400_and_the_connection_stays(server):
    chat = '{"messages": [{"role": "user", "content": "hi", "name": %s}], "max_tokens": 1}'
    tools = '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "x": %s}]}'
    cases = [("/v1/chat/completions", chat % _nested(600)), ("/v1/chat/completions", tools % _nested(900)),
             ("/v1/kv/generate", chat % _nested(800)),
             ("/v1/kv/materialize", '{"context": %s}' % _nested(995, '"\\ud83d\\ude00"')),
             ("/v1/kv/materialize", '{"context": %s}' % _nested(5000, '"\\ud800"'))]
    with server.http() as http:
        for path, body in cases:
            response = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
            status, code, message = error_of(response)
            assert (status, code) == (400, "invalid_request"), (path, message)
            assert "64" in message and "nest" in message
            assert response.headers.get("connection") != "close"
        # shallow nesting is still read, and the same client keeps working
        ok = http.post("/v1/kv/tokenize", content=b'{"text": "still here"}')
        assert ok.status_code == 200 and ok.json()["token_ids"]
        shallow = http.post("/v1/kv/materialize", content=('{"context": %s}' % _nested(40, "1")).encode())
        assert error_of(shallow)[:2] == (400, "invalid_request")  # read, and refused by the schema


# -- 5. never fits -------------------------------------------------------------------------------------


def test_a_request_that_can_never_fit_is_a_400(tight):
    with tight.http() as http:
        for path, body in [("/v1/kv/complete", {"prompt": "hi", "max_tokens": 1000}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 1000, "stream": True})]:
            response = http.post(path, json=body)
            status, code, message = error_of(response)
            assert (status, code) == (400, "invalid_request"), (path, status, message)
            assert message.startswith("this request can never fit") and "retry-after" not in response.headers


# -- 6. quotas and the idle TTL -------------------------------------------------------------------------


def test_live_handle_quota_per_tenant(tight):
    with kvbaton.connect(tight.url, token=TOKEN_A) as a, kvbaton.connect(tight.url, token=TOKEN_B) as b:
        release_all(tight, TOKEN_A)
        live = a.stats().handles_live
        h = a.materialize("Hi")
        a.fork(h, 16)
        a.fork(h, 16)  # 33 live
        with pytest.raises(QuotaExceeded, match="40"):
            a.fork(h, 16)
        assert a.stats().handles_live == live + 33  # the refused fork made nothing
        other = b.materialize("B is not limited by A's handles")
        b.release(other)
        with tight.http(token=TOKEN_A) as http:
            status, code, _ = error_of(http.post("/v1/kv/fork", json={"handle": h.id, "k": 16}))
            assert (status, code) == (429, "quota_exceeded")
        release_all(tight, TOKEN_A)
        assert len(a.fork(a.materialize("Hi"), 16)) == 16  # room again after release_all
        release_all(tight, TOKEN_A)


def test_a_quota_answer_tells_openai_clients_not_to_retry(tight):
    openai = pytest.importorskip("openai")
    with kvbaton.connect(tight.url, token=TOKEN_A) as a:
        release_all(tight, TOKEN_A)
        h = a.materialize("Hi")
        a.fork(h, 16)
        a.fork(h, 16)  # 33 live of 40: a chat request for 8 choices would pass the quota
        sent = Counting()
        with openai.OpenAI(base_url=f"{tight.url}/v1", api_key=TOKEN_A, max_retries=3,
                           http_client=httpx.Client(transport=sent)) as oa, pytest.raises(openai.RateLimitError) as err:
            oa.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}], n=8)
        assert err.value.code == "quota_exceeded" and err.value.response.headers["x-should-retry"] == "false"
        assert sent.paths == ["/v1/chat/completions"]  # the client did not retry what cannot succeed
        release_all(tight, TOKEN_A)


def test_kv_bytes_quota_per_tenant(tight):
    with kvbaton.connect(tight.url, token=TOKEN_A) as a:
        release_all(tight, TOKEN_A)
        h = a.materialize(" ".join(["word"] * 100))
        assert h.num_tokens >= 100
        a.fork(h, 8)  # about 900 tokens of a 1024-token (64-block) quota
        with pytest.raises(QuotaExceeded, match="KV"):
            a.fork(h, 8)
        release_all(tight, TOKEN_A)


def test_handle_token_quota_per_tenant(tight):
    with kvbaton.connect(tight.url, token=TOKEN_A) as a, kvbaton.connect(tight.url, token=TOKEN_B) as b:
        release_all(tight, TOKEN_A)
        live = a.stats().handles_live
        h = a.materialize(list(range(1000, 1100)))  # 100 tokens
        a.fork(h, 8)  # 900 tokens of the tenant's 960
        with pytest.raises(QuotaExceeded) as refused:
            a.fork(h, 1)  # 1000: under the KV quota (1024), over the handle-token one
        assert "handle-token quota of 960 tokens" in str(refused.value) and "1000 tokens" in str(refused.value)
        assert a.stats().handles_live == live + 9  # the refused fork made nothing
        b.release(b.fork(b.materialize(list(range(1000, 1100))), 8))  # another tenant's tokens are its own
        release_all(tight, TOKEN_A)


def test_idle_handles_expire_after_the_ttl(extra_servers):
    ttl = extra_servers["ttl"]
    ttl.wait_healthy()
    with ttl.http() as http:
        h = http.post("/v1/kv/materialize", json={"context": "Forgotten soon."}).json()
        until(lambda: http.get("/v1/kv/stats").json()["handles_live"] == 0, "the idle handle swept")
        assert error_of(http.post("/v1/kv/fork", json={"handle": h["id"]}))[:2] == (410, "handle_released")


@pytest.mark.unit
def test_owners_pick_handles_idle_longer_than_the_ttl():
    from kvbaton.backend.server.tenancy import Owners

    now = [100.0]
    owners = Owners(clock=lambda: now[0])
    owners.add("t", [("old", 3), ("used", 3)])
    now[0] = 105.0
    owners.use("t", ["used"])
    now[0] = 110.0
    assert owners.idle(ttl=7.0) == ["old"]
    assert sorted(owners.idle(ttl=1.0)) == ["old", "used"]


@pytest.mark.unit
def test_a_handle_another_server_of_the_cluster_made_is_its_tenants_here_and_that_servers_to_expire():
    from kvbaton.backend.server.tenancy import Owners

    now = [100.0]
    made_elsewhere = {"theirs": ("ta", 12)}  # what the cluster's control says (Cluster.handle_owner)
    owners = Owners(clock=lambda: now[0], lookup=made_elsewhere.get)
    owners.add("ta", [("mine", 3)])
    with pytest.raises(HandleNotFound):
        owners.check("tb", ["theirs"])  # another tenant: as if it did not exist
    owners.check("ta", ["theirs"])  # its tenant's, on this server too
    assert owners.owner("theirs") == "ta" and owners.holding("ta") == (2, 15)
    with pytest.raises(HandleNotFound):
        owners.check("ta", ["never-made"])
    now[0] = 200.0
    assert owners.idle(ttl=10.0) == ["mine"]  # its TTL is the server's that made it


@pytest.mark.unit
def test_the_handle_token_quota_counts_live_and_pending_tokens():
    from kvbaton.backend.server.tenancy import Owners, Quota

    owners = Owners(Quota(max_handle_tokens=100))
    owners.add("t", [("h", 40)])
    with owners.admit("t", handles=1, tokens=40):  # a fork in flight: 80 of 100
        with pytest.raises(QuotaExceeded, match="to 120 tokens .* quota of 100 tokens"):
            owners.admit("t", handles=1, tokens=40)
        owners.admit("u", handles=1, tokens=100).close()  # other tenants are not counted
    owners.admit("t", handles=1, tokens=60).close()  # the first admission settled: 100 of 100 fits
    owners.released(["h"])
    owners.admit("t", handles=1, tokens=100).close()


# -- 7. retained OpenAI handles and other tenants ------------------------------------------------------


def test_a_full_pool_never_evicts_another_tenants_retained_handles(tight):
    with tight.http(token=TOKEN_A) as a, tight.http(token=TOKEN_B) as b:
        a.post("/v1/kv/release_all")
        b.post("/v1/kv/release_all")
        words = a.post("/v1/kv/tokenize", json={"text": " apple" * 160}).json()["token_ids"]
        assert 150 <= len(words) <= 170

        def chat(http: httpx.Client, agent: str, text: str) -> httpx.Response:
            return http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": text}], "max_tokens": 2, "kvbaton": {"agent": agent}})

        assert chat(a, "writer", " apple" * 160).status_code == 200  # A's slot retains ~11 of 16 blocks
        # B needs those blocks: A's idle retained handle may be spilled (its K/V recomputed from lineage
        # on A's next turn), but it stays A's: B never releases another tenant's handle.
        assert chat(b, "reader", " pear" * 160).status_code == 200
        assert chat(b, "other", " plum" * 160).status_code == 200
        assert a.post("/v1/kv/release_all").json()["released"] == 1  # A's retained handle is still live and A's
        assert b.post("/v1/kv/release_all").json()["released"] >= 1


def test_sigterm_ends_active_streams_cleanly() -> None:
    """A server told to stop while streams are generating ends them at their next token, in-band
    (``server_unavailable``), and exits 0 with no traceback in its log (uvicorn would otherwise cancel
    each stream after its grace period, logging a traceback for each). A long materialize in flight
    (one engine call, which cannot stop midway) is answered, not cancelled (issue 49 item 16)."""
    from kvbaton.bench.corpus import document

    proc = ServerProcess(["--kv-budget", "256MiB", "--log-level", "info"]).start()
    streams = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a long story."}], "n": 2}),
               ("/v1/completions", {"prompt": "Once upon a time"}), ("/v1/kv/complete", {"prompt": "One, two,"})]
    started = [threading.Event() for _ in streams]
    errors: list[dict] = []

    def stream(k: int, path: str, body: dict) -> None:
        with proc.http() as http, http.stream("POST", path, json={**body, "max_tokens": 200, "ignore_eos": True,
                                                                   "stream": True}) as r:
            for line in r.iter_lines():
                started[k].set()
                if line.startswith("data: {") and '"error"' in line:
                    errors.append(json.loads(line.removeprefix("data: "))["error"])

    materialized: list[int] = []

    def materialize() -> None:
        with proc.http(timeout=WAIT_S) as http:
            materialized.append(http.post("/v1/kv/materialize", json={"context": document(1500, seed=9)}).status_code)

    def running() -> float:
        with proc.http() as http:
            text = http.get("/metrics").text
        found = re.search(r"^kvbaton_tenant_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    threads = [threading.Thread(target=stream, args=(k, *s)) for k, s in enumerate(streams)]
    try:
        for t in threads:
            t.start()
        until(lambda: all(e.is_set() for e in started), "every stream's first event")
        threads.append(threading.Thread(target=materialize))
        threads[-1].start()
        until(lambda: running() == 4 or bool(materialized), "the materialize in flight next to the three streams")
        assert not materialized, materialized  # (still in flight)
        proc.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(WAIT_S)
        assert proc.proc.wait(WAIT_S) == 0, proc.output()
        assert len(errors) == 3 and {e["code"] for e in errors} == {"server_unavailable"}, errors
        assert materialized == [200], proc.output()  # answered within the grace period (--shutdown-timeout)
        assert "Traceback" not in proc.log.read_text(errors="replace"), proc.output()
    finally:
        proc.stop()
        proc.log.unlink(missing_ok=True)


def test_sigterm_is_a_clean_exit_that_removes_the_tier_files(tmp_path: Path) -> None:
    """`kill <pid>` (what systemd and docker send) closes the engine: exit 0, no tier files left."""
    tier_dir = tmp_path / "tier"
    proc = ServerProcess(["--kv-budget", "8MiB", "--tier", f"disk:32MiB:{tier_dir}"]).start()
    try:
        with proc.http() as http:
            assert http.post("/v1/kv/materialize", json={"context": "a few words " * 20}).status_code == 200
        assert (tier_dir / "owner.lock").exists()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(30) == 0, proc.output()
        assert not any(tier_dir.glob("*.safetensors")) and not (tier_dir / "owner.lock").exists()
    finally:
        proc.stop()
        proc.log.unlink(missing_ok=True)


def test_an_unexpected_error_keeps_the_connection_and_is_logged_with_the_status_sent(caplog, monkeypatch) -> None:
    """A server bug is a 500, and a failure while the engine cannot serve a 503 with Retry-After: each
    answered with the error schema on the same keep-alive connection, and the access log says the
    status the client got (the real app and model under uvicorn, with an injected fault)."""
    import uvicorn
    from kvbaton.backend import Engine
    from kvbaton.backend.server import create_app
    from server_fixtures import free_port

    engine = Engine(kv_budget="16MiB")
    outage: list[str] = []
    monkeypatch.setattr(engine, "tokenize", lambda text: (_ for _ in ()).throw(RuntimeError("an injected bug")))
    monkeypatch.setattr(engine, "healthy", lambda: (not outage, outage[0] if outage else ""))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        until(lambda: server.started, "uvicorn to start")
        caplog.set_level("INFO", logger="kvbaton.access")
        with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=WAIT_S) as http:
            bug = http.post("/v1/kv/tokenize", json={"text": "hi"})
            outage.append("an injected outage")
            down = http.post("/v1/kv/tokenize", json={"text": "hi"})
            outage.clear()
            fine = http.post("/v1/kv/detokenize", json={"token_ids": [1]})
            ends = {r.extensions["network_stream"].get_extra_info("client_addr") for r in (bug, down, fine)}
        assert len(ends) == 1  # one connection: neither failure dropped it
        assert error_of(bug)[:2] == (500, "internal_error") and "RuntimeError" in error_of(bug)[2]
        assert error_of(down)[:2] == (503, "server_unavailable") and down.headers["retry-after"]
        assert fine.status_code == 200
        lines = [r.getMessage() for r in caplog.records if r.name == "kvbaton.access"]
        assert any(line.startswith("POST /v1/kv/tokenize 500") for line in lines), lines
        assert any(line.startswith("POST /v1/kv/tokenize 503") for line in lines), lines
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        engine.close()
