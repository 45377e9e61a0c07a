"""Server processes that benchmarks, tests and scripts start on loopback: a free port, a command that
dies with its parent, waiting until the server answers ``/health``, stopping it.

Invariants: every wait has a deadline; a server that does not come up in time is stopped (by the
caller's ``stop``) before the error is raised, so nothing is left running; a server started through
:func:`dies_with_parent` gets SIGTERM when the process that started it dies, however it dies (an OOM
kill of a test worker once left its servers running as orphans, 3 GB of them).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Sets PR_SET_PDEATHSIG (kept across exec), checks that the parent did not die before that, then becomes
# the real command: argv = [expected parent pid, executable, args...].
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit("the process that started this one is already gone")
os.execv(sys.argv[2], sys.argv[2:])
"""


def dies_with_parent(command: list[str], python: str | None = None) -> list[str]:
    """``command`` started so that it gets SIGTERM when the calling process dies (Linux; elsewhere it
    runs unchanged). ``python`` runs the small launcher (this interpreter by default). Start it from a
    thread that lives as long as the process should: the kernel signals when the starting thread ends."""
    if not sys.platform.startswith("linux"):
        return command
    return [python or sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout: float, *, stop: Callable[[], Any],
                 headers: Mapping[str, str] | None = None, interval: float = 0.3,
                 output: Callable[[], str] = lambda: "", name: str = "server") -> None:
    """Return once ``GET <url>/health`` answers 200. RuntimeError, with ``output()`` (the server's
    log), when ``proc`` exits first, or after ``timeout`` s (``stop()`` is called first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{output()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", headers=dict(headers or {}), timeout=2.0).status_code == 200:
                return
        time.sleep(interval)
    stop()
    raise RuntimeError(f"{name} not healthy after {timeout:.0f} s:\n{output()}")


def stop_process(proc: subprocess.Popen[Any], grace: float) -> int | None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited after ``grace`` s; waits for the exit (at
    most ``grace`` s more) and returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)
    return proc.returncode


def start_kvbaton_serve(*flags: str, timeout: float = 180.0) -> tuple[subprocess.Popen[bytes], str]:
    """``kvbaton serve`` of this interpreter on a free loopback port with ``flags`` (dies with this process),
    once it answers ``/health``: the process and its URL (stop it with :func:`stop_process`)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--port", str(port), "--log-level", "warning", *flags]
    proc = subprocess.Popen(dies_with_parent(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def output() -> str:  # the server's stderr, once it has exited (a live one would block the read)
        return proc.stderr.read().decode() if proc.stderr is not None and proc.poll() is not None else ""

    wait_healthy(url, proc, timeout, stop=lambda: stop_process(proc, 30), output=output, name="kvbaton serve")
    return proc, url
