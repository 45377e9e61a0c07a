"""Auth, tenant isolation, limits and the bind policy of ``kvbaton serve``."""

from __future__ import annotations

import os
import subprocess
import sys

import kvbaton
import pytest
from kvbaton import HandleNotFound, HandleReleased
from kvbaton.errors import Unauthorized
from server_fixtures import TOKEN_A, TOKEN_B, free_port


def _error(response) -> tuple[int, str]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "type", "param"}, body
    return response.status_code, body["error"]["code"]


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN_A + "x"])
def test_every_request_needs_the_token(secure_server, token):
    with secure_server.http(token=token or "") as http:
        if token is None:
            http.headers.pop("Authorization", None)
        for method, path, body in [("GET", "/health", None), ("GET", "/metrics", None),
                                   ("GET", "/openapi.json", None), ("GET", "/v1/models", None),
                                   ("POST", "/v1/kv/materialize", {"context": "x"}),
                                   ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
            response = http.request(method, path, json=body)
            assert _error(response) == (401, "unauthorized"), path
            assert response.headers["www-authenticate"] == "Bearer"
    with secure_server.http() as http:
        http.headers["Authorization"] = f"Basic {TOKEN_A}"
        assert http.get("/health").status_code == 401


def test_sdk_maps_401(secure_server):
    with kvbaton.connect(secure_server.url, token="nope") as client, pytest.raises(Unauthorized):
        client.stats()
    with kvbaton.connect(secure_server.url, token=TOKEN_B) as client:
        assert client.health()["status"] == "ok"


def test_tenants_cannot_see_each_others_handles(secure_server):
    a = kvbaton.connect(secure_server.url, token=TOKEN_A)
    b = kvbaton.connect(secure_server.url, token=TOKEN_B)
    with a, b:
        mine = a.materialize("Tenant A's private context.")
        unknown = "0" * 32
        for ref in (mine.id, mine):  # by id and as a whole handle object
            for op in (lambda h: b.resume(h, "x", max_tokens=1), lambda h: b.fork(h), lambda h: b.release(h),
                       lambda h: b.extend(h, "more"), lambda h: b.resume_stream(h, "x", max_tokens=1),
                       lambda h: b.generate([{"role": "user", "content": "x"}], handle=h, max_tokens=1)):
                with pytest.raises(HandleNotFound) as seen:
                    op(ref)
                with pytest.raises(HandleNotFound) as baseline:
                    op(unknown)
                # same type, same wording: B cannot tell A's handle from one that never existed
                assert str(seen.value).replace(mine.id, unknown) == str(baseline.value)
        with secure_server.http(token=TOKEN_B) as http:
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                         "kvbaton": {"handle": mine.id}})
            assert _error(r) == (404, "handle_not_found")
        # B's attempts changed nothing for A
        (child,) = a.fork(mine, 1)
        a.release([mine, child])
        with pytest.raises(HandleReleased):
            a.fork(mine)
        with pytest.raises(HandleNotFound):  # B does not learn that it existed and was released
            b.fork(mine)


def test_limits(secure_server):
    with secure_server.http() as http:
        assert _error(http.post("/v1/kv/materialize", content=b"x" * 100_000)) == (413, "payload_too_large")
        h = http.post("/v1/kv/materialize", json={"context": "Limits."}).json()
        assert _error(http.post("/v1/kv/resume", json={"handle": h["id"], "max_tokens": 5})) == (400, "invalid_request")
        ok = http.post("/v1/kv/resume", json={"handle": h["id"], "max_tokens": 4})
        assert ok.status_code == 200
        http.post("/v1/kv/release", json={"handles": [h["id"], ok.json()["handle"]["id"]]})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_non_loopback_bind_without_token_is_refused(host):
    env = {k: v for k, v in os.environ.items() if k != "KVBATON_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "kvbaton.cli", "serve", "--host", host, "--port", str(free_port())],
        check=False, capture_output=True, text=True, timeout=60, env=env,
    )
    assert done.returncode == 2
    assert "requires a token" in done.stderr and host in done.stderr


def test_cli_help_and_info():
    for args in (["--help"], ["serve", "--help"], ["info", "--help"]):
        done = subprocess.run([sys.executable, "-m", "kvbaton.cli", *args], check=False, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "usage: kvbaton" in done.stdout
    assert "--kv-budget" in subprocess.run([sys.executable, "-m", "kvbaton.cli", "serve", "--help"],
                                           check=False, capture_output=True, text=True, timeout=60).stdout


def test_bind_policy():
    from kvbaton.errors import InvalidRequest
    from kvbaton.serverconf import check_bind

    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        check_bind(host, [])
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        with pytest.raises(InvalidRequest, match="requires a token"):
            check_bind(host, [])
        check_bind(host, ["a-token"])
