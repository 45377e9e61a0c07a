"""Real ``kvbaton serve`` subprocesses on free loopback ports, for the server tests.

tests/conftest.py imports the fixtures (``server``, ``secure_server``), so that every test module
shares one process of each per session. Each server is a separate process: the tests talk to it
over HTTP only.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from kvbaton.bench.processes import dies_with_parent, free_port, stop_process, wait_healthy

TOKEN_A = "tenant-a-token"
TOKEN_B = "tenant-b-token"
STARTUP_TIMEOUT_S = 180.0  # the very first model conversion on a fresh machine takes ~35 s


class ServerProcess:
    """One ``python -m kvbaton.cli serve`` process; its output goes to a log file shown on failure."""

    def __init__(self, args: Sequence[str] = (), *, token: str | None = None, port: int | None = None) -> None:
        self.args = list(args)
        self.token = token
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="kvbaton-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvbaton.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "warning", *self.args]

    def start(self, wait: bool = True) -> ServerProcess:
        # One torch thread per server: the tests run the client process and up to three servers on a
        # couple of cores, and oversubscribed OpenMP threads slow every step several times over.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env.pop("KVBATON_TOKEN", None)
        env.pop("KVBATON_API_KEY", None)
        with self.log.open("ab") as log:
            # Dies with this test process: a killed test worker leaves no server behind.
            self.proc = subprocess.Popen(dies_with_parent(self.command()), stdout=log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        assert self.proc is not None
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        wait_healthy(self.url, self.proc, timeout, stop=self.stop, headers=headers, interval=0.2, output=self.output)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 10)

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, connections drop."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def http(self, token: str | None = None, timeout: float = 60.0) -> httpx.Client:
        token = token if token is not None else self.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


def _open_server() -> ServerProcess:
    """Open server (loopback, no token) with a small pool; max_tokens capped at 64."""
    return ServerProcess(["--kv-budget", "96MiB", "--max-tokens", "64", "--default-max-tokens", "8"])


def _secure_server() -> ServerProcess:
    """Two tenants (TOKEN_A, TOKEN_B), max_tokens capped at 4, 64 KiB bodies: auth, tenancy and fuzzing."""
    return ServerProcess(
        ["--kv-budget", "64MiB", "--max-tokens", "4", "--default-max-tokens", "4", "--max-body-bytes", "65536",
         "--token", TOKEN_A, "--token", TOKEN_B],
        token=TOKEN_A,
    )


SERVERS = {"server": _open_server, "secure_server": _secure_server}


@pytest.fixture(scope="session")
def server_processes(request: pytest.FixtureRequest) -> Iterator[dict[str, ServerProcess]]:
    """Starts, all at once, every server some collected test uses (their start-up is mostly imports:
    in parallel they cost the wall time of one), and stops them at the end of the session."""
    needed = {name for item in request.session.items for name in getattr(item, "fixturenames", ()) if name in SERVERS}
    with running({name: SERVERS[name]() for name in sorted(needed)}) as procs:
        yield procs


@contextlib.contextmanager
def running(procs: dict[str, ServerProcess]) -> Iterator[dict[str, ServerProcess]]:
    """Starts every server at once (their start-ups overlap) and stops them all, logs removed, at the end."""
    for proc in procs.values():
        proc.start(wait=False)
    try:
        yield procs
    finally:
        for proc in procs.values():  # all told at once: their shutdowns overlap, as their start-ups did
            if proc.proc is not None and proc.proc.poll() is None:
                proc.proc.terminate()
        for proc in procs.values():
            proc.stop()
            proc.log.unlink(missing_ok=True)


def _ready(procs: dict[str, ServerProcess], name: str) -> ServerProcess:
    if name not in procs:  # requested dynamically: start it now
        procs[name] = SERVERS[name]().start(wait=False)
    procs[name].wait_healthy()
    return procs[name]


@pytest.fixture(scope="session")
def server(server_processes: dict[str, ServerProcess]) -> ServerProcess:
    """Open server (loopback, no token), 96 MiB pool, max_tokens capped at 64."""
    return _ready(server_processes, "server")


@pytest.fixture(scope="session")
def secure_server(server_processes: dict[str, ServerProcess]) -> ServerProcess:
    """Tokens TOKEN_A and TOKEN_B (two tenants), 64 MiB pool, max_tokens capped at 4, 64 KiB bodies."""
    return _ready(server_processes, "secure_server")
