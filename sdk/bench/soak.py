"""Soak: many clients for a bounded time against real ``kvbaton serve`` processes, everything that
can go wrong going wrong meanwhile; what is left at the end must be nothing.

Phase 1 (one device, ``--persist``, two tenants): ``--clients`` client threads until ``--duration``
runs out, each picking at random native calls (materialize + resume, generate; streamed or not),
OpenAI chat and completions (streamed or not, with an agent header so the server retains their
handles), releases, and streams dropped after their first event (a client disconnecting). Each
client keeps a few exact handles live. The disk tier lives on a small tmpfs mounted for the run
(when this process may mount one: root), smaller than the tier's own budget, so it fills and tier
writes fail with ENOSPC; elsewhere a disk tier of a small budget fills by its capacity instead
(the record says which, ``tier_fs``). Then the server is restarted (SIGTERM) and every handle the
clients kept is resumed: ``handles_recovered`` of ``handles_kept``. Then ``release_all`` for each
tenant: the live handles and the pool blocks held by anything but the prefix cache must be 0.

Phase 2 (``--devices cpu,cpu``; not with ``--quick`` or ``--no-cluster``): a quarter of the clients
streaming against a two-worker server while one worker is killed (SIGKILL) half-way; the server
must keep answering (failed requests 503 ``server_unavailable``, never 500), and leave nothing
after ``release_all``.

The record: requests per kind, errors by class (HTTP status and error code, or the transport
exception), dropped streams, the server's RSS sampled every 5 s through the load (growth over the
load, and over its second half: growth that goes on there is a leak, growth that stops is warm-up),
handles kept and recovered, and the leaks after ``release_all`` (handles, blocks) of each phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
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
from kvbaton.bench.common import format_table
from kvbaton.bench.corpus import QUESTIONS, document

TOKENS = ("soak-tenant-a", "soak-tenant-b")
QUICK_ARGS = ["--quick"]
KEEP_PER_CLIENT = 3
MAX_TOKENS = 4
DROP_RATE = 0.15  # share of streamed requests the client abandons after the first event
MIB = 2**20
LOG_TAIL = 6000  # characters of the servers' log kept in the record (warnings and tracebacks)


# -- servers ----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``kvbaton serve`` process (restartable on the same port), its log in a temporary file."""

    def __init__(self, args: list[str], token: str | None = None) -> None:
        self.args = args
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="kvbaton-soak-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> Server:
        import httpx

        cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *self.args]
        env = {k: v for k, v in os.environ.items() if k != "KVBATON_TOKEN"}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvbaton serve exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", headers=self.headers, timeout=2).status_code == 200:
                    return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"kvbaton serve not healthy after {timeout} s:\n{self.output()}")

    def rss_bytes(self) -> int | None:
        if self.proc is None:
            return None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode

    def output(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")
        return ""

    def close(self) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)


@contextlib.contextmanager
def small_tier_dir(mib: int) -> Iterator[tuple[Path, str]]:
    """A directory for the disk tier: a ``mib`` MiB tmpfs when one can be mounted here, else a plain
    temporary directory; and what it is (for the record)."""
    root = Path(tempfile.mkdtemp(prefix="kvbaton-soak-tier-"))
    mounted = False
    why = "not root"
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("mount"):
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "kvbaton-soak", str(root)],
                              capture_output=True, text=True)
        mounted = done.returncode == 0
        why = done.stderr.strip() or f"mount exited with {done.returncode}"
    try:
        yield root, (f"tmpfs of {mib} MiB" if mounted else f"disk (no tmpfs: {why}); the tier fills by its budget")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(root)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


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

    def step(self) -> None:
        rng = self.rng
        streamed = rng.random() < 0.5
        op = rng.choice(("materialize", "resume", "generate", "chat", "completion", "release"))
        sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
        if op == "materialize" or (op in ("resume", "release") and not self.kept):
            made = self.post("materialize", "/v1/kv/materialize",
                             {"context": f"{self.system}\nNote {rng.randrange(10**6)}: {self.question()}"})
            if made is not None:
                self.kept.append(made["id"])
                while len(self.kept) > KEEP_PER_CLIENT:
                    self.post("release", "/v1/kv/release", {"handles": [self.kept.pop(0)]})
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
            body = {"model": "default", "messages": [{"role": "user", "content": self.question()}], **sampling}
            headers = {"X-Kvbaton-Agent": f"agent{self.index % 8}"}
            (self.stream if streamed else self.post)("chat", "/v1/chat/completions", body, headers)
        elif op == "completion":
            body = {"model": "default", "prompt": self.question(), **sampling}
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
    """``release_all`` for every tenant; then the live handles and the blocks anything but the cache holds."""
    import httpx

    released = 0
    stats: dict[str, Any] = {}
    for token in tokens:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            released += int(http.post("/v1/kv/release_all").json()["released"])
            stats = http.get("/v1/kv/stats").json()
    return {"released": released, "leaked_handles": int(stats["handles_live"]),
            "leaked_blocks": int(stats["blocks_used"]) - int(stats["blocks_cache_only"])}


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


# -- the run ----------------------------------------------------------------------------------------

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


def persistent_phase(clients: int, seconds: float, kv_budget: str, tier_mib: int, seed: int) -> dict[str, Any]:
    tally = Tally()
    system = "You answer questions about these notes.\n" + document(120, seed=seed)
    with small_tier_dir(tier_mib) as (tier, tier_fs):
        # The tier's budget is twice the tmpfs: writes run into ENOSPC before the tier thinks it is full.
        args = ["--persist", "--tier", f"disk:{2 * tier_mib}MiB:{tier}", "--kv-budget", kv_budget,
                "--max-tokens", "64", "--default-max-tokens", str(MAX_TOKENS), "--max-handles-per-tenant", "100000",
                "--max-handle-tokens-per-tenant", "0",
                *[a for t in TOKENS for a in ("--token", t)]]
        server = Server(args, token=TOKENS[0])
        try:
            server.start()
            load(server.url, min(clients, 2), min(seconds / 2, 5), TOKENS, Tally(), system, seed)  # warm-up
            with rss_samples(server) as samples:
                pool = load(server.url, clients, seconds, TOKENS, tally, system, seed)
            tier_errors = tier_write_errors(server.url, TOKENS[0])
            exit_code = server.stop()
            server.start()
            kept, ok = recovered(server.url, pool)
            left = leaks(server.url, TOKENS)
            server.stop()
            logs = server.output()  # both runs' output: what a 500 or a failed exit was
        finally:
            server.close()
    return {"phase": "persistent", "clients": clients, "seconds": seconds, "tier_fs": tier_fs,
            "tier_errors": tier_errors,
            "requests": dict(tally.requests), "errors": dict(tally.errors), "dropped_streams": tally.dropped,
            **rss_fields(samples), "clean_exit_code": exit_code, "handles_kept": kept, "handles_recovered": ok, **left,
            "server_log_tail": logs[-LOG_TAIL:]}


def cluster_phase(clients: int, seconds: float, kv_budget: str, seed: int) -> dict[str, Any]:
    import httpx

    tally = Tally()
    system = "You answer questions about these notes.\n" + document(120, seed=seed)
    server = Server(["--devices", "cpu,cpu", "--kv-budget", kv_budget, "--max-tokens", "64",
                     "--default-max-tokens", str(MAX_TOKENS)])
    killed: list[int] = []

    def kill_a_worker() -> None:
        workers = httpx.get(f"{server.url}/v1/kv/stats", timeout=60).json()["cluster"]["workers"]
        pid = next(w["pid"] for w in workers if w.get("pid"))
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    try:
        server.start()
        with rss_samples(server) as samples:
            load(server.url, clients, seconds, (None,), tally, system, seed, midway=kill_a_worker)
        healthy = httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        left = leaks(server.url, (None,))
        server.stop()
        logs = server.output()
    finally:
        server.close()
    return {"phase": "cluster", "clients": clients, "seconds": seconds, "workers_killed": len(killed),
            "healthy_after": healthy, "requests": dict(tally.requests), "errors": dict(tally.errors),
            "dropped_streams": tally.dropped, **rss_fields(samples), **left,
            "server_log_tail": logs[-LOG_TAIL:]}


def run(duration: float = 120.0, clients: int = 64, kv_budget: str = "96MiB", tier_mib: int = 24,
        cluster: bool = True, seed: int = 0) -> dict[str, Any]:
    phases = [persistent_phase(clients, duration, kv_budget, tier_mib, seed)]
    if cluster:
        phases.append(cluster_phase(max(clients // 4, 2), max(duration / 2, 10.0), kv_budget, seed))
    return {"benchmark": "soak", "duration_s": duration, "clients": clients, "kv_budget": kv_budget,
            "tier_mib": tier_mib, "max_tokens": MAX_TOKENS, "drop_rate": DROP_RATE, "rows": phases}


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:+.0f} MiB" if value < 0 or value > 0 else "0 MiB"


def _growth(row: dict[str, Any]) -> str:
    late = row.get("rss_growth_second_half_bytes")  # records before the samples have only the total
    return _mib(row["rss_growth_bytes"]) + ("" if late is None else f" ({_mib(late)})")


def table(payload: dict[str, Any]) -> str:
    """One row per phase: load, errors by class, leaks after ``release_all``, RSS growth, recovery."""
    columns = ["phase", "clients x s", "requests", "errors by class", "dropped streams", "leaked handles",
               "leaked blocks", "RSS growth (2nd half)", "restart / worker kill"]
    rows = []
    for r in payload["rows"]:
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "none"
        if r["phase"] == "persistent":
            extra = f"{r['handles_recovered']} of {r['handles_kept']}"
            phase = f"one device, --persist, tier on {r['tier_fs']} ({r.get('tier_errors', '?')} tier errors)"
        else:
            extra = f"worker killed: {r['workers_killed']}, healthy after: {r['healthy_after']}"
            phase = "--devices cpu,cpu, one worker SIGKILLed"
        rows.append([phase, f"{r['clients']} x {r['seconds']:g}", sum(r["requests"].values()), errors,
                     r["dropped_streams"], r["leaked_handles"], r["leaked_blocks"], _growth(r), extra])
    return format_table(columns, rows)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load in phase 1 (default 120)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients in phase 1 (default 64)")
    parser.add_argument("--kv-budget", default="96MiB", help="the servers' KV pool (default 96MiB)")
    parser.add_argument("--tier-mib", type=int, default=24, help="size of the tier's tmpfs in MiB (default 24)")
    parser.add_argument("--no-cluster", action="store_true", help="skip phase 2 (the multi-device worker kill)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 8 clients for 6 s, no multi-device phase (well under a minute of load)")
    record.add_arguments(parser, "soak")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.clients, args.no_cluster = min(args.duration, 6.0), min(args.clients, 8), True
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # A SIGTERM (timeout, CI) unwinds like Ctrl-C: servers stopped, the tmpfs unmounted.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    args.quick_record = args.quick_record or args.quick
    with record.Recording.from_args("soak", args, argv) as rec:
        payload = run(args.duration, args.clients, args.kv_budget, args.tier_mib, not args.no_cluster, args.seed)
        print(table(payload))
        print(json.dumps({r["phase"]: {k: r[k] for k in ("leaked_handles", "leaked_blocks")} for r in payload["rows"]}))
        print(f"\nwritten: {rec.write(payload)}")
