"""The soak's harness (:mod:`kvbaton.bench.soak` and its phases): real ``kvbaton serve`` processes,
small volumes (a real tmpfs where this process may mount one), client threads that pick random
requests and tally every answer by class, and the checks after the load: handles recovered after a
restart, leaks after ``release_all``, the server's RSS sampled through the load.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbaton.bench import record
from kvbaton.bench.corpus import QUESTIONS
from kvbaton.bench.processes import dies_with_parent, free_port, stop_process, wait_healthy

TOKENS = ("soak-tenant-a", "soak-tenant-b")
KEEP_PER_CLIENT = 3
MAX_TOKENS = 4
DROP_RATE = 0.15  # share of streamed requests the client abandons after the first event
MIB = 2**20
LOG_TAIL = 6000  # characters of the servers' log kept in the record (warnings and tracebacks)


# -- servers ----------------------------------------------------------------------------------------


class Server:
    """One ``kvbaton serve`` process (restartable on the same port), its log in a temporary file."""

    def __init__(self, args: list[str], token: str | None = None) -> None:
        self.args = args
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="kvbaton-soak-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> Server:
        cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *self.args]
        env = {k: v for k, v in os.environ.items() if k != "KVBATON_TOKEN"}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(dies_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_healthy(self.url, self.proc, timeout, stop=self.stop, headers=self.headers, output=self.output,
                     name="kvbaton serve")
        return self

    def rss_bytes(self) -> int | None:
        return record.proc_status_bytes(self.proc.pid, "VmRSS") if self.proc is not None else None

    def stop(self) -> int | None:
        return stop_process(self.proc, 60) if self.proc is not None else None

    def output(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")
        return ""

    def close(self) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)


@contextlib.contextmanager
def small_volume(mib: int) -> Iterator[tuple[Path, str | None]]:
    """A fresh temporary directory with a ``mib`` MiB tmpfs mounted on it when this process may mount
    one (root), and why not otherwise (None when mounted); unmounted and removed at the end. A real
    small filesystem: writes meet ``ENOSPC`` where a real full disk would, no fault injection."""
    root = Path(tempfile.mkdtemp(prefix="kvbaton-volume-"))
    why: str | None = "not root"
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("mount"):
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "kvbaton-volume", str(root)],
                              check=False, capture_output=True, text=True)
        why = None if done.returncode == 0 else done.stderr.strip() or f"mount exited with {done.returncode}"
    try:
        yield root, why
    finally:
        if why is None:
            subprocess.run(["umount", "-l", str(root)], check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def fill_volume(directory: Path) -> Path:
    """Another writer filling the volume of ``directory`` to the last byte (ENOSPC): its file, to delete."""
    path = directory / "kvbaton-filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (MIB, 64 * 1024, 4096, 512):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, bytes(chunk))
    finally:
        os.close(fd)
    return path


@contextlib.contextmanager
def small_tier_dir(mib: int) -> Iterator[tuple[Path, str]]:
    """A directory for the disk tier: a ``mib`` MiB tmpfs when one can be mounted here, else a plain
    temporary directory; and what it is (for the record)."""
    with small_volume(mib) as (root, why):
        yield root, (f"tmpfs of {mib} MiB" if why is None else f"disk (no tmpfs: {why}); the tier fills by its budget")


# -- clients ----------------------------------------------------------------------------------------


class Tally:
    """Requests and errors of every client, by kind and by class."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.dropped = 0

    def ok(self, kind: str) -> None:
        with self.lock:
            self.requests[kind] += 1

    def error(self, kind: str, cls: str) -> None:
        with self.lock:
            self.requests[kind] += 1
            self.errors[cls] += 1


def error_class(exc: BaseException | None = None, response: Any = None) -> str:
    """``<status> <code>`` of an error answer, or the transport exception's name."""
    if response is not None:
        try:
            code = response.json().get("error", {}).get("code", "?")
        except (ValueError, AttributeError):
            code = "not-json"
        return f"{response.status_code} {code}"
    return type(exc).__name__ if exc is not None else "unknown"


class SoakClient:
    """One client thread's loop: random operations until the deadline, a few exact handles kept."""

    def __init__(self, index: int, url: str, token: str | None, tally: Tally, system: str, seed: int) -> None:
        import httpx

        self.index = index
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=300.0)
        self.tally = tally
        self.rng = random.Random(seed)
        self.system = system
        self.kept: list[str] = []

    def question(self) -> str:
        return QUESTIONS[self.rng.randrange(len(QUESTIONS))]

    def post(self, kind: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        import httpx

        try:
            response = self.http.post(path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            self.tally.error(kind, error_class(exc))
            return None
        if response.status_code != 200:
            self.tally.error(kind, error_class(response=response))
            return None
        self.tally.ok(kind)
        return response.json()

    def stream(self, kind: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        """A streamed request, read to its end or dropped after its first event."""
        import httpx

        drop = self.rng.random() < DROP_RATE
        try:
            with self.http.stream("POST", path, json={**body, "stream": True}, headers=headers) as response:
                if response.status_code != 200:
                    response.read()
                    self.tally.error(kind, error_class(response=response))
                    return
                for line in response.iter_lines():
                    if drop and line.startswith("data:"):
                        with self.tally.lock:
                            self.tally.dropped += 1
                        break  # closing the response disconnects mid-stream
                    if line.startswith("event: error"):
                        self.tally.error(kind, "stream error event")
                        return
        except httpx.HTTPError as exc:
            self.tally.error(kind, error_class(exc))
            return
        self.tally.ok(kind)

    def materialize(self) -> None:
        """A new handle to keep (the oldest kept one released beyond ``KEEP_PER_CLIENT``)."""
        made = self.post("materialize", "/v1/kv/materialize",
                         {"context": f"{self.system}\nNote {self.rng.randrange(10**6)}: {self.question()}"})
        if made is not None:
            self.kept.append(made["id"])
            while len(self.kept) > KEEP_PER_CLIENT:
                self.post("release", "/v1/kv/release", {"handles": [self.kept.pop(0)]})

    def step(self) -> None:
        rng = self.rng
        streamed = rng.random() < 0.5
        op = rng.choice(("materialize", "resume", "generate", "chat", "completion", "release"))
        sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
        if op == "materialize" or (op in ("resume", "release") and not self.kept):
            self.materialize()
        elif op == "resume":
            body = {"handle": rng.choice(self.kept), "suffix": " " + self.question(), **sampling}
            if streamed:
                self.stream("resume", "/v1/kv/resume", body)  # its result is released by nobody: release_all
            else:
                result = self.post("resume", "/v1/kv/resume", body)
                if result is not None:
                    self.post("release", "/v1/kv/release", {"handles": [result["handle"]["id"]]})
        elif op == "generate":
            body = {"messages": [{"role": "system", "content": self.system},
                                 {"role": "user", "content": self.question()}], **sampling}
            if streamed:
                self.stream("generate", "/v1/kv/generate", body)
            else:
                result = self.post("generate", "/v1/kv/generate", body)
                if result is not None:
                    self.post("release", "/v1/kv/release", {"handles": [result["handle"]["id"]]})
        elif op == "chat":
            body = {"messages": [{"role": "user", "content": self.question()}], **sampling}
            headers = {"X-Kvbaton-Agent": f"agent{self.index % 8}"}
            (self.stream if streamed else self.post)("chat", "/v1/chat/completions", body, headers)
        elif op == "completion":
            body = {"prompt": self.question(), **sampling}
            (self.stream if streamed else self.post)("completion", "/v1/completions", body)
        else:
            self.post("release", "/v1/kv/release", {"handles": [self.kept.pop(rng.randrange(len(self.kept)))]})

    def run(self, deadline: float) -> None:
        try:
            while time.monotonic() < deadline:
                self.step()
        finally:
            self.http.close()


def load(url: str, clients: int, seconds: float, tokens: tuple[str | None, ...], tally: Tally,
         system: str, seed: int, midway: Any = None) -> list[SoakClient]:
    """``clients`` threads (spread over ``tokens``' tenants) for ``seconds``; ``midway()`` runs half-way."""
    deadline = time.monotonic() + seconds
    pool = [SoakClient(i, url, tokens[i % len(tokens)], tally, system, seed * 1000 + i) for i in range(clients)]
    threads = [threading.Thread(target=c.run, args=(deadline,), daemon=True) for c in pool]
    for t in threads:
        t.start()
    if midway is not None:
        time.sleep(seconds / 2)
        midway()
    for t in threads:
        t.join()
    return pool


def leaks(url: str, tokens: tuple[str | None, ...]) -> dict[str, int]:
    """``release_all`` for every tenant; then the live handles and the blocks anything but the caches hold (the
    prefix cache, and released approximate turns kept for their agent's next turn)."""
    import httpx

    released = 0
    stats: dict[str, Any] = {}
    for token in tokens:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            released += int(http.post("/v1/kv/release_all").json()["released"])
            stats = http.get("/v1/kv/stats").json()
    return {"released": released, "leaked_handles": int(stats["handles_live"]),
            "leaked_blocks": int(stats["blocks_used"]) - int(stats["blocks_cache_only"])
            - int(stats.get("blocks_retained_only", 0))}


def tier_write_errors(url: str, token: str) -> int | None:
    """The failed tier reads and writes the server counted (a full tmpfs: ENOSPC)."""
    import httpx

    stats = httpx.get(f"{url}/v1/kv/stats", headers={"Authorization": f"Bearer {token}"}, timeout=120).json()
    return (stats.get("cache") or {}).get("tier_errors")


def recovered(url: str, pool: list[SoakClient]) -> tuple[int, int]:
    """How many of the handles the clients kept resume after the restart (by their own tenant)."""
    import httpx

    kept = ok = 0
    for client in pool:
        headers = {"Authorization": f"Bearer {client.token}"} if client.token else {}
        with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
            for hid in client.kept:
                kept += 1
                answer = http.post("/v1/kv/resume", json={"handle": hid, "suffix": " Again", "max_tokens": 1})
                if answer.status_code == 200:
                    ok += 1
                    http.post("/v1/kv/release", json={"handles": [answer.json()["handle"]["id"]]})
    return kept, ok


# -- the server's memory ---------------------------------------------------------------------------

RSS_EVERY_S = 5.0  # how often the server's RSS is sampled during the load


@contextlib.contextmanager
def rss_samples(server: Server, every: float = RSS_EVERY_S) -> Iterator[list[tuple[float, int]]]:
    """Sample the server's RSS every ``every`` s while inside: ``[(seconds since start, bytes)]``, first
    and last sample taken at entry and exit. Growth that goes on in the second half of a long load is a
    leak; growth that stops is warm-up (allocator high water, kernels for the shapes seen)."""
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    stop = threading.Event()

    def take() -> None:
        rss = server.rss_bytes()
        if rss is not None:
            samples.append((round(time.monotonic() - start, 1), rss))

    def loop() -> None:
        while not stop.wait(every):
            take()

    take()
    thread = threading.Thread(target=loop, name="kvbaton-soak-rss", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()
        take()


def rss_fields(samples: list[tuple[float, int]]) -> dict[str, Any]:
    """The record's RSS fields: start, end, growth over the load and over its second half, the samples."""
    if not samples:
        return {"rss_start_bytes": None, "rss_end_bytes": None, "rss_growth_bytes": None,
                "rss_growth_second_half_bytes": None, "rss_samples": []}
    (t0, first), (t1, last) = samples[0], samples[-1]
    middle = min(samples, key=lambda s: abs(s[0] - (t0 + t1) / 2))[1]
    return {"rss_start_bytes": first, "rss_end_bytes": last, "rss_growth_bytes": last - first,
            "rss_growth_second_half_bytes": last - middle, "rss_samples": [[t, b] for t, b in samples]}
