"""The soak's kernel-build phase (issue 39): a kernel build killed midway, then a start on its cache.

A build of the decode kernels runs in a subprocess on an empty ``KVBATON_CACHE_DIR`` (the model's
files linked from the user's cache, so the model's conversion is no part of the phase) and is
SIGKILLed, its compiler too, once it compiles (cpp_extension's ``lock`` file shows it). Then
``kvbaton serve`` starts on that cache and must come up within the build deadline
(``KVBATON_KERNELS_BUILD_TIMEOUT``) and answer: the kernels rebuilt (the killed build's lock found
stale and removed, :mod:`kvbaton.backend.compute.cpu.kernels`) or, past the deadline, on oneDNN;
never a start that hangs on the lock. With ``--quick`` it is the same phase: the kill comes seconds
into the build, and the start's build (about 40 s on 2 cores) is what it takes (the killed build left
no library to load).

The row (:func:`row`): how the build was stopped, how long it ran, the start's time to healthy and
to its first answer, the outcome, and what is left after ``release_all`` (handles, blocks).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbaton.bench.processes import dies_with_parent, free_port, stop_process, wait_healthy

BUILD_DEADLINE_S = 300.0  # the kernel build timeout of the phase's start (a build takes ~40 s on 2 cores)
LOG_TAIL = 6000  # characters of the server's log kept in the record


def _kernel_dir(cache: Path) -> Path:
    from kvbaton.backend.compute.cpu import kernels

    return cache / "kernels" / kernels.build_key()


def _killed_build(cache: Path, env: dict[str, str], wait_s: float) -> float | None:
    """Start a kernel build in a subprocess and SIGKILL it (its compiler too) once cpp_extension's
    ``lock`` file shows it compiling; seconds it ran (None: it never got that far within ``wait_s``)."""
    code = "from kvbaton.backend.compute.cpu import kernels; kernels.load()"
    proc = subprocess.Popen(dies_with_parent([sys.executable, "-c", code]), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = _kernel_dir(cache) / "lock"
    start = time.monotonic()
    try:
        while not lock.exists() and proc.poll() is None and time.monotonic() - start < wait_s:
            time.sleep(0.05)
        ran = time.monotonic() - start if lock.exists() else None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the build's whole session: python, ninja, the compiler
        proc.wait(30)
    return ran


def _start_and_ask(env: dict[str, str], log: Path, deadline_s: float, max_tokens: int) -> dict[str, Any]:
    """``kvbaton serve`` on the phase's cache until it answers one completion; the times, the answer's
    status and what is left after ``release_all``."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--kv-budget", "32MiB", "--log-level", "info", "--default-max-tokens", str(max_tokens)]
    t0 = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(dies_with_parent(cmd), stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(url, proc, deadline_s + 300, stop=lambda: stop_process(proc, 60), name="kvbaton serve",
                     output=lambda: log.read_text(errors="replace"))  # the build's deadline, then the model's load
        up = time.monotonic() - t0
        with httpx.Client(base_url=url, timeout=deadline_s + 120) as http:  # the first decode may load the kernels
            status = http.post("/v1/kv/complete", json={"prompt": "One, two,", "max_tokens": 2}).status_code
            answered = time.monotonic() - t0
            released = int(http.post("/v1/kv/release_all").json()["released"])
            stats = http.get("/v1/kv/stats").json()
    finally:
        stop_process(proc, 60)
    return {"start_s": round(up, 1), "first_answer_s": round(answered, 1), "status": status, "released": released,
            "leaked_handles": int(stats["handles_live"]),
            "leaked_blocks": int(stats["blocks_used"]) - int(stats["blocks_cache_only"])}


def kernel_build_phase(deadline_s: float = BUILD_DEADLINE_S, max_tokens: int = 4) -> dict[str, Any]:
    """A kernel build killed midway, then a start on the same cache (the module docstring)."""
    from kvbaton.backend.dirs import cache_dir

    cache = Path(tempfile.mkdtemp(prefix="kvbaton-soak-cache-"))
    log = Path(tempfile.mkstemp(prefix="kvbaton-soak-", suffix=".log")[1])
    for name in ("models", "hashes"):  # the model's conversion is no part of the phase: the user's own
        if (cache_dir() / name).exists():
            (cache / name).symlink_to(cache_dir() / name)
    env = {**{k: v for k, v in os.environ.items() if k != "KVBATON_TOKEN"}, "KVBATON_CACHE_DIR": str(cache),
           "KVBATON_KERNELS_BUILD_TIMEOUT": str(deadline_s)}
    try:
        killed_after = _killed_build(cache, env, wait_s=deadline_s)
        stale = (_kernel_dir(cache) / "lock").exists()
        started = _start_and_ask(env, log, deadline_s, max_tokens)
        logs = log.read_text(errors="replace")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        log.unlink(missing_ok=True)
    status = started.pop("status")
    outcome = ("fell back to oneDNN" if "decode kernels unavailable" in logs
               else "built" if "decode kernels built" in logs else "loaded the built kernels")
    return {"phase": "kernel_build",
            "mode": "build SIGKILLed mid-compile" if killed_after is not None else "the build never started compiling",
            "killed_after_s": round(killed_after, 1) if killed_after else None, "stale_lock": stale,
            "deadline_s": deadline_s, **started, "outcome": outcome,
            "stale_lock_removed": "left by a kernel build that was killed" in logs,
            "requests": {"complete": 1}, "errors": {} if status == 200 else {str(status): 1}, "dropped_streams": 0,
            "rss_growth_bytes": None, "server_log_tail": logs[-LOG_TAIL:]}


def row(r: dict[str, Any]) -> tuple[str, str, str]:
    """The soak table's phase, load and last column of this phase's record."""
    extra = (f"{r['outcome']}; up in {r['start_s']:g} s, first answer in {r['first_answer_s']:g} s "
             f"(deadline {r['deadline_s']:g} s)")
    return f"kernel build killed, then a start ({r['mode']})", "1 start", extra
