"""The soak's small-volume phase: ``--persist`` on a volume that fills (issue 39: a full volume used
to be a permanent outage, and the journal grew without bound).

``--volume-mib`` (default 12) MiB of tmpfs, mounted for the run (root; elsewhere a plain directory,
and the record's ``tier_fs`` says so), holds the disk tier (its budget four times the volume), the
handle journal and the saved blocks. Clients make handles for ``--volume-duration`` seconds (600;
20 with ``--quick``): materialize, extend (a conversation: each turn's journal line names its
parent), fork k=8 and release the forks (the journal's churn), OpenAI chat with an agent (its slot
is journaled), completions, releases. In each half another writer fills the volume to the last byte
(again and again for a while, as the tier gives its blocks back) and later deletes its file; the
server is restarted (SIGTERM: a clean exit on a full volume) between the halves. Reported: 503s,
**permanent 503s** (503s to requests that make handles with no success of such a request after
them, the final check included: target 0), ``/health`` every half second (its transitions, the
seconds degraded), the journal's size every half second (it must stay bounded), and at the end,
once the filler is gone, that ``/health`` is 200 again and a new handle can be made, every kept
handle resumes, and nothing leaks after ``release_all``; the RSS is the restarted server's, through
the second half.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Self

from kvbaton.bench.corpus import document
from kvbaton.bench.soak_harness import (
    LOG_TAIL,
    MAX_TOKENS,
    TOKENS,
    Server,
    SoakClient,
    Tally,
    error_class,
    fill_volume,
    leaks,
    recovered,
    rss_fields,
    rss_samples,
    small_volume,
)

HANDLE_KINDS = ("materialize", "extend", "fork", "chat")  # the requests that need the handle journal
MONITOR_EVERY_S = 0.5
FORK_K = 8


class VolumeTally(Tally):
    """A tally that also keeps when each request that needs the journal succeeded or got 503."""

    def __init__(self) -> None:
        super().__init__()
        self.start = time.monotonic()
        self.outcomes: list[tuple[float, bool]] = []  # (seconds since start, succeeded) of HANDLE_KINDS

    def ok(self, kind: str) -> None:
        super().ok(kind)
        self._outcome(kind, True)

    def error(self, kind: str, cls: str) -> None:
        super().error(kind, cls)
        if cls.startswith("503"):
            self._outcome(kind, False)

    def _outcome(self, kind: str, ok: bool) -> None:
        if kind in HANDLE_KINDS:
            with self.lock:
                self.outcomes.append((time.monotonic() - self.start, ok))


class VolumeClient(SoakClient):
    """A client whose requests make handles: a conversation (extend), forks made and released, agents."""

    def step(self) -> None:
        rng, sampling = self.rng, {"max_tokens": MAX_TOKENS, "temperature": 0.0}
        op = rng.choice(("materialize", "extend", "extend", "fork", "chat", "completion", "release"))
        if op == "materialize" or not self.kept:
            self.materialize()
        elif op == "extend":  # the conversation's next turn replaces the one before
            i = rng.randrange(len(self.kept))
            made = self.post("extend", "/v1/kv/extend", {"handle": self.kept[i], "context": " " + self.question()})
            if made is not None:
                old, self.kept[i] = self.kept[i], made["id"]
                self.post("release", "/v1/kv/release", {"handles": [old]})
        elif op == "fork":
            forks = self.post("fork", "/v1/kv/fork", {"handle": rng.choice(self.kept), "k": FORK_K})
            if forks is not None:
                self.post("release", "/v1/kv/release", {"handles": [h["id"] for h in forks["handles"]]})
        elif op == "chat":
            body = {"messages": [{"role": "user", "content": self.question()}], **sampling}
            self.post("chat", "/v1/chat/completions", body, {"X-Kvbaton-Agent": f"agent{self.index % 4}"})
        elif op == "completion":
            self.post("completion", "/v1/completions", {"prompt": self.question(), **sampling})
        else:
            self.post("release", "/v1/kv/release", {"handles": [self.kept.pop(rng.randrange(len(self.kept)))]})


class VolumeMonitor:
    """``/health`` and the journal's size every ``MONITOR_EVERY_S`` while inside (through restarts)."""

    def __init__(self, url: str, token: str, journal: Path, start: float) -> None:
        self.url, self.headers, self.journal, self.start = url, {"Authorization": f"Bearer {token}"}, journal, start
        self.health: list[tuple[float, str]] = []  # transitions only: (seconds, "ok" / "degraded" / "unhealthy"...)
        self.sizes: list[tuple[float, int]] = []
        self.degraded_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvbaton-soak-volume", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def status(self) -> str:
        import httpx

        try:
            answer = httpx.get(f"{self.url}/health", headers=self.headers, timeout=5.0)
        except httpx.HTTPError:
            return "down"
        return "ok" if answer.status_code == 200 else str(answer.json().get("status", answer.status_code))

    def _loop(self) -> None:
        while not self._stop.wait(MONITOR_EVERY_S):
            now = round(time.monotonic() - self.start, 1)
            status = self.status()
            if status == "degraded":
                self.degraded_s += MONITOR_EVERY_S
            if not self.health or self.health[-1][1] != status:
                self.health.append((now, status))
            with contextlib.suppress(OSError):
                self.sizes.append((now, self.journal.stat().st_size))


def _filled_for(volume: Path, seconds: float) -> None:
    """Another writer: fill the volume, again every half second (the tier gives its blocks back) for
    ``seconds``, then delete its file."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            fill_volume(volume)
            time.sleep(0.5)
    finally:
        (volume / "kvbaton-filler").unlink(missing_ok=True)


def _load_with_filler(server: Server, volume: Path | None, clients: int, seconds: float, tally: Tally, system: str,
                      seed: int, pool: list[SoakClient] | None = None) -> list[SoakClient]:
    """``clients`` volume clients for ``seconds`` (continuing ``pool``'s kept handles); the volume, when
    it is a real small one, filled from a third of the time to its half."""
    deadline = time.monotonic() + seconds
    clients_ = [VolumeClient(i, server.url, TOKENS[i % len(TOKENS)], tally, system, seed * 1000 + i)
                for i in range(clients)]
    for mine, before in zip(clients_, pool or []):
        mine.kept = list(before.kept)
    threads = [threading.Thread(target=c.run, args=(deadline,), daemon=True) for c in clients_]
    for t in threads:
        t.start()
    if volume is not None:
        time.sleep(seconds / 3)
        _filled_for(volume, seconds / 6)
    for t in threads:
        t.join()
    return clients_


def volume_phase(clients: int, seconds: float, kv_budget: str, volume_mib: int, seed: int) -> dict[str, Any]:
    import httpx

    tally = VolumeTally()
    system = "You answer questions about these notes.\n" + document(60, seed=seed)
    with small_volume(volume_mib) as (root, why):
        tier_fs = f"tmpfs of {volume_mib} MiB" if why is None else f"disk (no tmpfs: {why}); nothing fills it"
        volume = root if why is None else None
        tier = root / "tier"
        args = ["--persist", "--tier", f"disk:{4 * volume_mib}MiB:{tier}", "--kv-budget", kv_budget,
                "--max-tokens", "64", "--default-max-tokens", str(MAX_TOKENS), "--max-handles-per-tenant", "100000",
                "--max-handle-tokens-per-tenant", "0", *[a for t in TOKENS for a in ("--token", t)]]
        server = Server(args, token=TOKENS[0])
        try:
            server.start()
            with VolumeMonitor(server.url, TOKENS[0], tier / "state" / "handles.jsonl", tally.start) as monitor:
                pool = _load_with_filler(server, volume, clients, seconds / 2, tally, system, seed)
                exit_code = server.stop()  # a clean exit on a volume that may be full: saves what fits
                server.start()
                with rss_samples(server) as samples:  # the restarted server's, through the second half
                    pool = _load_with_filler(server, volume, clients, seconds / 2, tally, system, seed + 1, pool)
                # The end: the filler is gone; the server must be back by itself, and make handles again.
                healthy = False
                for _ in range(int(60 / MONITOR_EVERY_S)):
                    if monitor.status() == "ok":
                        healthy = True
                        break
                    time.sleep(MONITOR_EVERY_S)
                for token in TOKENS:
                    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"},
                                      timeout=300) as http:
                        made = http.post("/v1/kv/materialize", json={"context": "The last note."})
                        if made.status_code != 200:
                            tally.error("materialize", error_class(response=made))
                            continue
                        tally.ok("materialize")
                        http.post("/v1/kv/release", json={"handles": [made.json()["id"]]})
            kept, ok = recovered(server.url, pool)
            left = leaks(server.url, TOKENS)
            server.stop()
            logs = server.output()
        finally:
            server.close()
    sizes = [b for _, b in monitor.sizes]
    half = len(sizes) // 2
    outcomes = sorted(tally.outcomes)
    last_ok = max((t for t, ok in outcomes if ok), default=-1.0)
    return {"phase": "small-volume", "clients": clients, "seconds": seconds, "tier_fs": tier_fs,
            "volume_mib": volume_mib, "requests": dict(tally.requests), "errors": dict(tally.errors),
            "dropped_streams": tally.dropped, **rss_fields(samples),
            "handle_503s": sum(1 for _, ok in outcomes if not ok),
            "permanent_503s": sum(1 for t, ok in outcomes if not ok and t > last_ok),
            "healthy_at_end": healthy, "health_transitions": [[t, s] for t, s in monitor.health],
            "degraded_s": monitor.degraded_s, "clean_exit_code": exit_code,
            "journal_bytes_max": max(sizes, default=None), "journal_bytes_end": sizes[-1] if sizes else None,
            "journal_bytes_max_second_half": max(sizes[half:], default=None),
            "journal_samples": [[t, b] for t, b in monitor.sizes[:: max(len(monitor.sizes) // 200, 1)]],
            "handles_kept": kept, "handles_recovered": ok, **left, "server_log_tail": logs[-LOG_TAIL:]}


def _kib(value: int | None) -> str:
    return "-" if value is None else f"{value / 1024:.0f} KiB"


def describe(row: dict[str, Any]) -> tuple[str, str]:
    """The phase's table cells: what it is, and what it is about (recovery, 503s, health, journal)."""
    extra = (f"{row['handles_recovered']} of {row['handles_kept']}; permanent 503s: {row['permanent_503s']} "
             f"(of {row['handle_503s']}), degraded {row['degraded_s']:g} s, healthy at end: {row['healthy_at_end']}; "
             f"journal max {_kib(row['journal_bytes_max'])} ({_kib(row['journal_bytes_max_second_half'])} "
             "in the 2nd half)")
    return f"--persist on a small volume ({row['tier_fs']}), filled by another writer, restarted", extra
