"""What bounds a ``kvbaton serve`` against its clients: start-up checks, stalled connections, fair
request slots, stream caps, per-tenant metrics and events, bounded per-tenant memory, hung workers
(issue 39).

Specification:
- the socket is bound and every option checked before the model loads: a taken port, ``--token ''``
  or a limit out of range ends the process with a clear error before it logs that it loads anything;
- a connection that sends part of its headers (slowloris), nothing at all, or stops sending its body
  is closed after ``--client-timeout`` (the first two with 408); an answer the client does not read
  is abandoned after it (its request cancelled); a client that keeps up is unaffected;
- requests hold a slot while they run: beyond the server's slots they wait, and a slot that comes
  back goes to the next tenant in turn, so a tenant flooding the server delays its own requests, not
  another tenant's; a tenant's queue is bounded (429); open streams (generation and event streams)
  are capped per tenant and in all (429 ``quota_exceeded``), and come back when closed;
- a tenant's token reads only its own metrics (its requests, agents, usage; nothing of the pool or
  the other tenants), an admin token reads them all and nothing else; a tenant's events are numbered
  in its own sequence, which other tenants' activity does not move;
- a tenant keeps at most ``--max-registered-agents`` registered agents (its least recently registered
  dropped), and ``DELETE /v1/kv/agents?name=`` (``unregister_agent``) frees one; ``/v1/kv/fidelity``
  refuses a check longer than ``--max-fidelity-tokens`` with a 400;
- a hung (SIGSTOPped) cluster worker is found by its missed liveness pings (heartbeats): ``/health`` says
  the cluster is degraded and requests on its handles are answered by the other worker, until Ray has
  restarted it and it rejoined.
The model-free parts (the fair queue, the connection guard, the event views, the bounded caches)
are checked on their own below.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import anyio
import anyio.lowlevel
import httpx
import kvbaton
import pytest
from server_fixtures import TOKEN_A, TOKEN_B, ServerProcess, running

WAIT_S = 180.0  # how long a server may take to get somewhere (a busy 2-core machine), never a measured bound
ADMIN = "limits-admin-token"
CLIENT_TIMEOUT_S = 2
LIMITS = ["--kv-budget", "48MiB", "--token", TOKEN_A, "--token", TOKEN_B, "--admin-token", ADMIN,
          "--client-timeout", str(CLIENT_TIMEOUT_S), "--max-requests", "1", "--max-requests-per-tenant", "1",
          "--max-streams", "3", "--max-streams-per-tenant", "2", "--max-registered-agents", "2",
          "--max-event-streams", "3", "--max-event-streams-per-tenant", "2", "--event-stream-idle-timeout", "3",
          "--max-fidelity-tokens", "8", "--max-tokens", "64", "--default-max-tokens", "2",
          "--queue-timeout", str(WAIT_S)]  # a queued request waits as long as the tests do (a busy machine is slow)
HUNG = ["--devices", "cpu,cpu", "--kv-budget", "48MiB", "--heartbeat-timeout", "3"]


def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait for a state (polling; the assertion is on the state, never on the time it took)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"never got to: {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    with running({"limits": ServerProcess(LIMITS, token=TOKEN_A), "hung": ServerProcess(HUNG)}) as procs:
        yield procs


@pytest.fixture(scope="module")
def limits(servers) -> ServerProcess:
    servers["limits"].wait_healthy(WAIT_S)
    return servers["limits"]


def _exits_before_loading(args: list[str], port: int | None = None) -> str:
    proc = ServerProcess([*args, "--log-level", "info"], port=port)
    try:
        proc.start(wait=False)
        assert proc.proc is not None
        assert proc.proc.wait(WAIT_S) == 2
        return proc.output()
    finally:
        proc.stop()
        proc.log.unlink(missing_ok=True)


# -- start-up -------------------------------------------------------------------------------------------


def test_a_taken_port_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = _exits_before_loading([], port=taken.getsockname()[1])
    assert "cannot bind 127.0.0.1" in out and "in use" in out
    assert "loading" not in out and "serving" not in out


@pytest.mark.parametrize(("args", "says"), [
    (["--token", ""], "tokens must be non-empty"),
    (["--token", "a", "--admin-token", " "], "admin tokens must be non-empty"),
    (["--handle-ttl", "0"], "'--handle-ttl': input should be greater than 0"),
    (["--max-streams", "-1"], "'--max-streams'"),
    (["--client-timeout", "0"], "'--client-timeout'"),
    (["--max-kv-bytes-per-tenant", "lots"], "invalid KV budget"),
])
def test_a_bad_option_is_refused_before_the_model_loads(args, says):
    out = _exits_before_loading(args)
    assert says in out and "loading" not in out


# -- stalled connections ----------------------------------------------------------------------------------


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(WAIT_S)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_stalled_connections_are_closed_after_the_client_timeout(limits):
    port = limits.port
    with socket.create_connection(("127.0.0.1", port)) as slowloris:
        slowloris.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ")
        assert _read_all(slowloris).startswith(b"HTTP/1.1 408 ")
    with socket.create_connection(("127.0.0.1", port)) as silent:
        assert _read_all(silent).startswith(b"HTTP/1.1 408 ")
    with socket.create_connection(("127.0.0.1", port)) as slow_body:
        slow_body.sendall(b"POST /v1/kv/tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN_A.encode()
                          + b"\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n{\"text\":")
        assert _read_all(slow_body) == b""  # closed; no answer to a request that never arrived
    with limits.http() as http:  # a client that keeps up: keep-alive requests as ever
        for _ in range(3):
            assert http.post("/v1/kv/tokenize", json={"text": "hello"}).status_code == 200
    with limits.http(token=ADMIN) as admin:  # the stalled body is the client's doing: 499, never the server's 500
        counted = admin.get("/metrics").text
    assert re.search(r'^kvbaton_requests_total\{[^}]*status="499"[^}]*\} 1\.0$', counted, re.MULTILINE), counted
    assert 'status="500"' not in counted


# -- fair slots and stream caps ------------------------------------------------------------------------------


def _gauge(text: str, name: str) -> float:
    found = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_request_whose_client_left_before_its_answer_releases_what_it_made(server):
    """Issue 49 item 11: requests abandoned by a client timeout (materialize, a native generation, a
    kept chat answer) leave no handle behind once the server is done with them; a whole generation
    stops when its client is gone; and an answer that was delivered keeps its handle."""
    from kvbaton.bench.corpus import document

    with server.http() as http:
        def live() -> float:
            return _metric(http.get("/metrics").text, "kvbaton_handles_live")

        def idle() -> bool:
            return _metric(http.get("/metrics").text, "kvbaton_tenant_requests_running") == 0

        until(idle, "the server idle")
        before = live()
        abandoned = [  # each with a prompt of its own (no prefix-cache hit makes it quick)
            ("/v1/kv/materialize", {"context": document(800, seed=401)}),
            ("/v1/kv/complete", {"prompt": document(800, seed=402), "max_tokens": 64, "ignore_eos": True}),
            ("/v1/chat/completions", {"model": "smollm2-135m-instruct", "max_tokens": 64, "kvbaton": {"keep": True},
                                      "messages": [{"role": "user", "content": document(800, seed=403)}]}),
        ]
        for path, body in abandoned:
            with pytest.raises(httpx.TimeoutException):  # the client gives up long before the answer
                httpx.post(f"{server.url}{path}", json=body, timeout=0.05)
        until(idle, "the abandoned requests ended")
        until(lambda: live() == before, "the abandoned requests' handles released")
        kept = http.post("/v1/kv/materialize", json={"context": "delivered"}).json()  # answered: the caller's
        assert live() == before + 1
        http.post("/v1/kv/release", json={"handles": [kept["id"]]}).raise_for_status()


def test_a_fork_that_can_never_be_admitted_is_400_not_429(server):
    """Issue 49 item 16: retrying cannot help a fork of more children than any quota allows."""
    with server.http() as http:
        parent = http.post("/v1/kv/materialize", json={"context": "fork me"}).json()["id"]
        try:
            for k in (2**63, 10**6):
                refused = http.post("/v1/kv/fork", json={"handle": parent, "k": k})
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "k", refused.text
        finally:
            http.post("/v1/kv/release", json={"handles": [parent]})


def test_a_flooding_tenant_waits_its_turn_and_the_other_is_served_next(limits):
    """The order in which the queue hands out slots, not how long anything takes: the server's queue
    waits as long as the test (--queue-timeout WAIT_S), so a loaded machine only makes it slower."""
    body = {"prompt": "One, two, three, four,", "max_tokens": 8, "ignore_eos": True}
    done: list[str] = []
    lock = threading.Lock()
    statuses: list[int] = []

    def send(token: str, who: str) -> None:
        with limits.http(token=token, timeout=WAIT_S) as http:
            status = http.post("/v1/kv/complete", json=body).status_code
        with lock:
            statuses.append(status)
            done.append(who)

    flood = [threading.Thread(target=send, args=(TOKEN_A, "a")) for _ in range(5)]  # 1 running + 4 waiting
    for t in flood:
        t.start()
    with limits.http() as a:
        until(lambda: _gauge(a.get("/metrics").text, "kvbaton_tenant_requests_waiting") == 4, "A's queue full")
        refused = a.post("/v1/kv/complete", json=body)  # a fifth waiting request: over A's queue bound
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_exceeded"
    with lock:
        before = len(done)
    other = threading.Thread(target=send, args=(TOKEN_B, "b"))
    other.start()
    for t in [*flood, other]:
        t.join(WAIT_S)
        assert not t.is_alive(), f"a request of the flood still unanswered after {WAIT_S} s"
    assert statuses == [200] * 6
    # Round robin: after B queued, A got at most the slot that was next in turn (and the one running).
    assert done.index("b") <= before + 2, done


def test_event_streams_have_caps_of_their_own_and_end_when_idle(limits):
    """Issue 49 item 13: idle event streams (a dashboard left open) fill only the event streams' caps
    — the tenant's share, then the server's — never the generations'; and one that carries no event
    for --event-stream-idle-timeout ends by itself (a browser's EventSource reconnects)."""
    a, b = limits.http(token=TOKEN_A), limits.http(token=TOKEN_B)
    with a, b:
        opened = [a.stream("GET", "/v1/kv/events/stream") for _ in range(2)]
        try:
            for s in opened:
                assert s.__enter__().status_code == 200
            over = a.get("/v1/kv/events/stream")
            assert over.status_code == 429 and "open event streams" in over.json()["error"]["message"]
            # A's generations are not behind its (idle) event streams
            with a.stream("POST", "/v1/kv/complete", json={"prompt": "x", "max_tokens": 2, "stream": True}) as gen:
                assert gen.status_code == 200 and "event: result" in gen.read().decode()
            with b.stream("GET", "/v1/kv/events/stream") as third:  # the server's third and last event stream
                assert third.status_code == 200
                assert b.get("/v1/kv/events/stream").status_code == 429  # the server's limit, not B's
        finally:
            for s in opened:
                s.__exit__(None, None, None)
        until(lambda: _gauge(a.get("/metrics").text, "kvbaton_tenant_streams_open") == 0, "A's streams closed")
        with a.stream("GET", "/v1/kv/events/stream", timeout=WAIT_S) as idle:  # nothing happens for A: it ends
            assert idle.status_code == 200
            assert ": idle timeout" in "".join(idle.iter_text())


@pytest.mark.unit
def test_generation_streams_are_capped_per_tenant_and_in_all():
    from kvbaton.backend.server.concurrency import EVENTS, GENERATION, Concurrency
    from kvbaton.errors import QuotaExceeded

    slots = Concurrency(max_requests=None, per_tenant=None, max_streams=2, max_streams_per_tenant=1,
                        max_event_streams=1, max_event_streams_per_tenant=1)
    slots.open_stream("a", EVENTS)  # an event stream takes nothing from the generations
    slots.open_stream("a", GENERATION)
    with pytest.raises(QuotaExceeded, match="generation streams"):
        slots.open_stream("a")
    with pytest.raises(QuotaExceeded, match="event streams"):
        slots.open_stream("b", EVENTS)  # the server's one event stream is taken
    slots.open_stream("b")
    assert slots.usage("a") == (0, 0, 2)


def test_a_stream_stops_counting_once_it_said_it_ended(limits):
    """A client that starts its next stream as soon as the last one said it ended, before that response's
    connection has closed it, is not refused: the tenant's two streams (its limit) both said [DONE] and are
    still open on the wire, and a third is served."""
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "stream": True}

    def until_done(response: httpx.Response) -> None:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.strip() == "data: [DONE]":
                return
        raise AssertionError("the stream ended without [DONE]")

    with limits.http() as first, limits.http() as second, limits.http() as third:
        with first.stream("POST", "/v1/chat/completions", json=body) as one:
            until_done(one)
            with second.stream("POST", "/v1/chat/completions", json=body) as two:
                until_done(two)
                again = third.post("/v1/chat/completions", json=body)
                assert again.status_code == 200, again.text


# -- per-tenant metrics and events ---------------------------------------------------------------------------


def test_a_tenant_reads_only_its_own_metrics_and_the_admin_reads_them_all(limits):
    a, b = limits.http(token=TOKEN_A), limits.http(token=TOKEN_B)
    admin = limits.http(token=ADMIN)
    with a, b, admin:
        b_next = b.get("/v1/kv/events").json()["next"]
        a_tokens = 0
        for agent in ("alice", "alison", "alina"):
            r = a.post("/v1/kv/generate", json={"messages": [{"role": "user", "content": "Hi"}], "agent": agent})
            assert r.status_code == 200, r.text
            a_tokens += r.json()["timings"]["tokens_generated"]
            a.post("/v1/kv/release", json={"handles": [r.json()["handle"]["id"]]})
        r = b.post("/v1/kv/generate", json={"messages": [{"role": "user", "content": "Hi"}], "agent": "bob"})
        b_tokens = r.json()["timings"]["tokens_generated"]
        b.post("/v1/kv/release", json={"handles": [r.json()["handle"]["id"]]})
        mine, theirs, everything = a.get("/metrics").text, b.get("/metrics").text, admin.get("/metrics").text
        a_id = re.search(r'agent="alice",tenant="(t-[0-9a-f]+)"', mine).group(1)
        b_id = re.search(r'agent="bob",tenant="(t-[0-9a-f]+)"', theirs).group(1)
        assert "bob" not in mine and b_id not in mine and "alice" not in theirs and a_id not in theirs
        for shared in ("kvbaton_pool_blocks", "kvbaton_engine_tokens", "kvbaton_handles_live"):
            assert shared not in mine and shared in everything
        assert 'kvbaton_requests_total{endpoint="/v1/kv/generate",method="POST",status="200"} 3.0' in mine
        assert 'kvbaton_requests_total{endpoint="/v1/kv/generate",method="POST",status="200"} 1.0' in theirs
        generated = 'kvbaton_generated_tokens_total{endpoint="/v1/kv/generate"} '
        assert f"{generated}{a_tokens:.1f}" in mine and f"{generated}{b_tokens:.1f}" in theirs  # its own generations
        assert "alice" in everything and "bob" in everything
        assert admin.get("/v1/kv/stats").status_code == 401  # the admin token is no tenant
        # B's events: its own numbers, one request of its own since b_next, whatever A did meanwhile
        page = b.get("/v1/kv/events", params={"since": b_next}).json()
        requests = [e for e in page["events"] if e["kind"] == "request"]
        assert [e["agent"] for e in requests] == ["bob"] and requests[0]["seq"] == b_next + 1


# -- bounded per-tenant memory ------------------------------------------------------------------------------


def test_registered_agents_are_bounded_per_tenant_and_can_be_unregistered(limits):
    with kvbaton.connect(limits.url, token=TOKEN_A) as a, limits.http(token=TOKEN_B) as b:
        assert b.post("/v1/kv/agents", json={"name": "b-only", "fixed_prompt": "You are B."}).status_code == 200
        for name in ("first", "second", "third"):  # over A's limit of 2: "first" is dropped
            assert a.register_agent(name, f"You are the {name} agent.").fixed_tokens > 0
        assert _gauge(b.get("/metrics").text, "kvbaton_tenant_agents_registered") == 1  # B's own, untouched
        assert a.unregister_agent("first") is False  # dropped already
        assert a.unregister_agent("third") is True
        assert a.unregister_agent("third") is False
        assert a.unregister_agent("b-only") is False  # B's agent is no name of A's
        gone = b.delete("/v1/kv/agents", params={"name": "b-only"})
        assert gone.status_code == 200 and gone.json() == {"unregistered": True}


def test_fidelity_checks_are_bounded(limits):
    with limits.http() as http:
        h = http.post("/v1/kv/materialize", json={"context": "A short context to check."}).json()
        too_long = http.post("/v1/kv/fidelity", json={"handle": h["id"], "max_tokens": 9})
        assert too_long.status_code == 400 and "--max-fidelity-tokens" in too_long.json()["error"]["message"]
        assert http.post("/v1/kv/fidelity", json={"handle": h["id"], "max_tokens": 4}).status_code == 200
        http.post("/v1/kv/release", json={"handles": [h["id"]]})


# -- a hung cluster worker ----------------------------------------------------------------------------------


def test_a_hung_worker_is_reported_and_its_requests_fail_over(servers):
    cluster = servers["hung"]
    cluster.wait_healthy(WAIT_S)
    with cluster.http(timeout=WAIT_S) as http:
        h = http.post("/v1/kv/materialize", json={"context": "Notes kept on one worker."}).json()
        workers = {w["rank"]: w["pid"] for w in http.get("/v1/kv/stats").json()["cluster"]["workers"]}
        pid = workers[h["placement"]["worker"]]
        os.kill(pid, signal.SIGSTOP)
        try:
            # Without heartbeats this request would wait on the stopped worker forever.
            r = http.post("/v1/kv/resume", json={"handle": h["id"], "suffix": " and more", "max_tokens": 2})
            assert r.status_code == 200, r.text
            health = http.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert "heartbeat" in health.json()["reason"] and "1 of 2 workers alive" in health.json()["reason"]
            assert http.post("/v1/kv/complete", json={"prompt": "Still here?", "max_tokens": 2}).status_code == 200
        finally:
            with contextlib.suppress(ProcessLookupError):  # Ray killed it (to restart it): usually gone already
                os.kill(pid, signal.SIGCONT)
        # Ray restarts the killed worker (tests/test_multidevice.py waits for its rejoin); meanwhile it serves.
        assert http.get("/health").status_code == 200


# -- the model-free parts -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_fair_queue_hands_slots_round_robin_and_bounds_each_wait():
    from kvbaton.backend.server.concurrency import Concurrency
    from kvbaton.errors import QuotaExceeded, ServerUnavailable

    async def scenario() -> list[str]:
        slots = Concurrency(max_requests=1, per_tenant=None, max_streams=None, max_streams_per_tenant=None,
                            wait_s=5, max_queued=3)
        order: list[str] = []
        await slots.acquire("a")  # a holds the one slot

        async def wait(who: str, tenant: str) -> None:
            await slots.acquire(tenant)
            order.append(who)
            slots.release(tenant)

        async with anyio.create_task_group() as tasks:
            for i in range(3):
                tasks.start_soon(wait, f"a{i}", "a")
                await anyio.sleep(0.01)
            with pytest.raises(QuotaExceeded):  # a fourth waiting request of a: over its queue bound
                await slots.acquire("a")
            tasks.start_soon(wait, "b0", "b")
            await anyio.sleep(0.01)
            slots.release("a")
        short = Concurrency(max_requests=1, per_tenant=None, max_streams=None, max_streams_per_tenant=None, wait_s=0.05)
        await short.acquire("a")
        with pytest.raises(ServerUnavailable):
            await short.acquire("b")
        return order

    assert anyio.run(scenario) == ["a0", "b0", "a1", "a2"]


@pytest.mark.unit
def test_stream_counts_come_back_once_closed():
    from kvbaton.backend.server.concurrency import Concurrency
    from kvbaton.errors import QuotaExceeded

    slots = Concurrency(max_requests=None, per_tenant=None, max_streams=2, max_streams_per_tenant=1)
    close = slots.open_stream("a")
    with pytest.raises(QuotaExceeded):
        slots.open_stream("a")
    other = slots.open_stream("b")
    with pytest.raises(QuotaExceeded):
        slots.open_stream("c")  # the server's limit
    close()
    close()  # idempotent: counted back once
    slots.open_stream("c")
    other()
    assert slots.usage("a") == (0, 0, 0) and slots.usage("c") == (0, 0, 1)


@pytest.mark.unit
def test_an_unread_answer_is_abandoned_after_the_client_timeout():
    """The connection guard on a real uvicorn: a client that reads the head of a long answer and then
    nothing more has its connection aborted, and the app sees the disconnect (its request cancelled)."""
    from kvbaton.backend.server.listener import bind, bound_port, http_server
    from starlette.responses import StreamingResponse

    cancelled = threading.Event()

    async def endless():  # the body of an answer that never ends (a stream)
        try:
            while True:
                yield b"x" * 65536
                # as a real stream awaits its next token (a send to a gone client returns at once)
                await anyio.lowlevel.checkpoint()
        finally:
            cancelled.set()

    async def app(scope, receive, send):  # a bare ASGI app
        if scope["type"] == "http":
            await StreamingResponse(endless())(scope, receive, send)

    sock = bind("127.0.0.1", 0)
    server = http_server(app, log_level="warning", client_timeout=0.5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", bound_port(sock)))
    client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    client.recv(100)  # the head, then nothing more is read
    try:
        assert cancelled.wait(WAIT_S)
    finally:
        client.close()
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


@pytest.mark.unit
def test_a_trickling_stream_nobody_reads_is_abandoned_though_its_writes_never_pause():
    """Delivery is measured, not writes (issue 49 item 12): a token stream trickles far less than the
    socket buffers, so the server's writes never pause; a client that reads nothing (a 1 KiB receive
    buffer) still has its connection aborted after the client timeout, its request cancelled. A slow
    client that does read is never cut off."""
    from kvbaton.backend.server.listener import bind, bound_port, http_server
    from starlette.responses import StreamingResponse

    ended: dict[str, threading.Event] = {"/unread": threading.Event(), "/read": threading.Event()}
    sent: dict[str, int] = {"/unread": 0, "/read": 0}

    def trickle(path: str):
        async def tokens():  # ~2 KiB a tenth of a second, as a generation's chunks come
            try:
                for _ in range(40 if path == "/read" else 10_000):
                    sent[path] += 1
                    yield b"data: " + b"t" * 2048 + b"\n\n"
                    await anyio.sleep(0.1)
            finally:
                ended[path].set()
        return tokens()

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await StreamingResponse(trickle(scope["path"]))(scope, receive, send)

    sock = bind("127.0.0.1", 0)
    server = http_server(app, log_level="warning", client_timeout=1.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    unread = socket.socket()
    unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    reader = socket.socket()
    try:
        unread.connect(("127.0.0.1", bound_port(sock)))
        unread.sendall(b"GET /unread HTTP/1.1\r\nHost: x\r\n\r\n")  # and nothing is ever read
        reader.connect(("127.0.0.1", bound_port(sock)))
        reader.sendall(b"GET /read HTTP/1.1\r\nHost: x\r\n\r\n")
        got = 0
        while not ended["/read"].is_set() or got < 40 * 2056:  # slowly, but it reads everything
            piece = reader.recv(4096)
            if not piece:
                break
            got += len(piece)
            time.sleep(0.05)
        assert ended["/unread"].wait(WAIT_S), "the unread stream was not abandoned within WAIT_S"
        assert sent["/unread"] < 10_000 and got >= 40 * 2056  # cut off; the slow reader got every byte
    finally:
        unread.close()
        reader.close()
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


@pytest.mark.unit
def test_every_connection_sends_small_writes_at_once(monkeypatch):
    """TCP_NODELAY on each connection of the server's own socket: an answer's head and body are two writes,
    and with Nagle's algorithm the body would wait for the client's delayed ACK (40 ms a request on Linux)."""
    from kvbaton.backend.server import listener

    seen: list[int] = []
    made = listener.GuardedH11Protocol.connection_made

    def recording(self, transport):
        made(self, transport)
        seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    monkeypatch.setattr(listener.GuardedH11Protocol, "connection_made", recording)

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    sock = listener.bind("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP  # so asyncio itself sets TCP_NODELAY on what it accepts
    server = listener.http_server(app, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{listener.bound_port(sock)}") as client:
            deadline = time.monotonic() + WAIT_S
            while True:  # until uvicorn serves (its start-up runs in the thread)
                try:
                    assert client.get("/").text == "ok"
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
        assert seen and all(seen)
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


@pytest.mark.unit
def test_a_taken_port_is_an_error_naming_the_address():
    from kvbaton.backend.server.listener import bind
    from kvbaton.errors import InvalidRequest

    first = bind("127.0.0.1", 0)
    try:
        with pytest.raises(InvalidRequest, match=r"cannot bind 127\.0\.0\.1:\d+"):
            bind("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()


@pytest.mark.unit
def test_event_views_number_each_tenants_events_on_their_own():
    from kvbaton.backend.server.eventviews import EventViews
    from kvbaton.types import Event, Events

    engine = [Event(seq=i, kind="request", time=0.0, agent=f"{'ab'[i % 2]}/x") for i in range(1, 8)]

    def read(since: int) -> Events:
        after = [e for e in engine if e.seq > since]
        return Events(events=after, next=after[-1].seq if after else since)

    def route(event: Event) -> list[tuple[str, Event]]:
        return [(event.agent.split("/")[0], event)]

    views = EventViews(read, route, renumber=True)
    views.pump()
    a, b = views.page("a", 0), views.page("b", 0)
    assert [e.seq for e in a.events] == [1, 2, 3] and [e.seq for e in b.events] == [1, 2, 3, 4]
    assert views.page("a", a.next).events == [] and views.page("nobody", 0).events == []
    engine.append(Event(seq=8, kind="request", time=0.0, agent="b/x"))
    views.pump()
    assert [e.seq for e in views.page("b", 4).events] == [5] and views.last("a") == 3


@pytest.mark.unit
def test_registered_agents_drop_a_tenants_least_recently_registered():
    from kvbaton.backend.server.tenancy import RegisteredAgents
    from kvbaton.backend.tenants import AgentRef

    agents = RegisteredAgents(2)
    assert agents.add("t", AgentRef("t", "a")) == [] and agents.add("t", AgentRef("t", "b")) == []
    assert agents.add("u", AgentRef("u", "a")) == []  # another tenant's count
    assert agents.add("t", AgentRef("t", "a")) == []  # again: refreshed
    assert agents.add("t", AgentRef("t", "c")) == [AgentRef("t", "b")]
    assert agents.remove("t", AgentRef("t", "a")) and not agents.remove("t", AgentRef("t", "b"))
    assert agents.count("t") == 1 and agents.count("u") == 1


@pytest.mark.unit
def test_the_grammar_cache_is_bounded_by_count_and_size():
    from kvbaton.backend.runtime.constrained import _GrammarCache

    cache = _GrammarCache(max_entries=3, max_bytes=10**9)
    formats = [json.dumps({"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {f"k{i}": {"type": "integer"}}}}}) for i in range(5)]
    for f in formats:
        cache.get(f)
    assert len(cache) == 3
    small = _GrammarCache(max_entries=100, max_bytes=len(formats[0]) + len(cache.get(formats[0])) + 1)
    for f in formats:
        small.get(f)
    assert len(small) == 1 and small.bytes <= small.max_bytes


@pytest.mark.unit
def test_every_server_option_is_one_server_args_field_generated_into_the_cli_and_documented():
    """Issue 45 item 8: the options are declared once (ServerArgs); the CLI is generated from them (its
    defaults are the fields' own), and docs/server.md's table names every one."""
    from pathlib import Path

    from kvbaton.backend.server.args import ServerArgs, _flag, from_cli, server_options
    from kvbaton.cli import build_parser

    assert from_cli(build_parser().parse_args(["serve"]), {}) == ServerArgs()
    parsed = from_cli(build_parser().parse_args(["serve", "--max-streams", "7", "--api-key", "k", "--shared-spans",
                                                 "--served-model-name", "a", "b"]), {})
    assert (parsed.max_streams, parsed.tokens(), parsed.shared_spans, parsed.served_model_names) == (
        7, ["k"], True, ["a", "b"])
    assert from_cli(build_parser().parse_args(["serve"]), {"KVBATON_API_KEY": "x,y"}).tokens() == ["x", "y"]
    table = (Path(__file__).parents[1] / "docs" / "server.md").read_text()
    missing = [_flag(name) for name, _, _ in server_options() if f"`{_flag(name)}" not in table]
    assert not missing, f"options without a row in docs/server.md: {missing}"


@pytest.mark.unit
def test_every_limit_is_checked_without_an_engine():
    from kvbaton.backend.server.app import check_serve_options
    from kvbaton.errors import InvalidRequest

    check_serve_options("127.0.0.1", [], max_streams=0, max_requests=4, handle_ttl=3.0)
    for options in ({"threads": 0}, {"max_requests_per_tenant": -1}, {"max_fidelity_tokens": True},
                    {"served_model_names": [""]}, {"reuse": "sometimes"}, {"no_such_option": 1},
                    {"admin_token": ["a b"]}, {"client_timeout": -1.0}):
        with pytest.raises(InvalidRequest):
            check_serve_options("127.0.0.1", [], **options)
    with pytest.raises(InvalidRequest):
        check_serve_options("0.0.0.0", [""])
