"""Soak: many clients for a bounded time against real ``kvbaton serve`` processes, everything that
can go wrong going wrong meanwhile; what is left at the end must be nothing.

Phase 0 (not with ``--no-kernel-build``): a kernel build killed midway, then a start on its cache
(:mod:`kvbaton.bench.soak_kernels`).

Phase 1 (one device, ``--persist``, two tenants): ``--clients`` client threads until ``--duration``
runs out, each picking at random native calls (materialize + resume, generate; streamed or not),
OpenAI chat and completions (streamed or not, with an agent header so the server retains their
handles), releases, and streams dropped after their first event (a client disconnecting). Each
client keeps a few exact handles live. The disk tier lives on a small tmpfs mounted for the run
(when this process may mount one: root), smaller than the tier's own budget, so the tier fills the
volume (it holds what the free space allows, the journal's reserve kept); elsewhere a disk tier of
a small budget fills by its capacity instead (the record says which, ``tier_fs``). Then the server
is restarted (SIGTERM) and every handle the clients kept is resumed: ``handles_recovered`` of
``handles_kept``. Then ``release_all`` for each tenant: the live handles and the pool blocks held by
anything but the prefix cache must be 0.

Phase "small volume" (``--persist`` on a small volume that another writer fills, a restart midway;
``--no-volume`` skips it): :mod:`kvbaton.bench.soak_persist`. Permanent 503s (target 0), ``/health``'s
transitions, the journal's size (bounded), kept handles resumed, leaks.

Phase 2 (``--devices cpu,cpu``; not with ``--quick`` or ``--no-cluster``): a quarter of the clients
streaming against a two-worker server while one worker is killed (SIGKILL) half-way; the server
must keep answering (failed requests 503 ``server_unavailable``, never 500), and leave nothing
after ``release_all``.

Phase 3 (``--checkpointer-threads``, default 20, 4 with ``--quick``; not with ``--no-checkpointer``):
retained handles are a cache, not a reservation. A LangGraph app with a checkpointer (``MemorySaver``;
a reader and a reviewer, each behind its own system prompt, the reviewer reusing the reader's notes
approximately: ``KvbatonChatModel``'s default ``reuse="auto"``) runs one thread after another against
a server with a small pool (``--checkpointer-kv-budget``, 96 blocks), every thread keeping its handles;
after each thread an unrelated request of more than half the pool (distinct text: no cache hit) must
still run (``unrelated_failed``, target 0), and from the fourth thread on the thread three back takes
a second turn (its handles long spilled). Retained memory: the live handles and the blocks they hold
on the device, sampled after each thread (their maxima must stay within the pool and the adapter's
per-thread bound); then every thread is released and nothing may be left.

The record: requests per kind, errors by class (HTTP status and error code, or the transport
exception), dropped streams, the server's RSS sampled every 5 s through the load (growth over the
load, and over its second half: growth that goes on there is a leak, growth that stops is warm-up),
handles kept and recovered, and the leaks after ``release_all`` (handles, blocks) of each phase.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import threading
import time
from collections import Counter
from typing import Any

from kvbaton.bench import record, soak_kernels, soak_persist
from kvbaton.bench.common import format_table
from kvbaton.bench.corpus import document
from kvbaton.bench.soak_harness import (
    DROP_RATE,
    LOG_TAIL,
    MAX_TOKENS,
    MIB,
    TOKENS,
    Server,
    Tally,
    leaks,
    load,
    recovered,
    rss_fields,
    rss_samples,
    small_tier_dir,
    tier_write_errors,
)

CHECKPOINTER_THREADS = 20
QUICK_CHECKPOINTER_THREADS = 4
CHECKPOINTER_KV_BUDGET = "96 blocks"
UNRELATED_SHARE = 0.57  # of the pool: more than the half of it idle threads could pin (55 of 96 blocks)
NOTES_WORDS = 80  # each thread's own notes (~150 prompt tokens per agent)
REVISIT_EVERY = 3  # from the fourth thread on, the thread three back takes its second turn
QUICK_ARGS = ["--quick"]


def persistent_phase(clients: int, seconds: float, kv_budget: str, tier_mib: int, seed: int) -> dict[str, Any]:
    tally = Tally()
    system = "You answer questions about these notes.\n" + document(120, seed=seed)
    with small_tier_dir(tier_mib) as (tier, tier_fs):
        # The tier's budget is twice the tmpfs: the volume's free space bounds it, not its budget.
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


class _Pressure:
    """The checkpointer phase's tally: turns and unrelated requests, errors by class, retained maxima."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.handles_max = self.blocks_max = self.per_thread_max = 0

    def attempt(self, kind: str, fn: Any) -> Any:
        self.requests[kind] += 1
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every failure is counted by class, the phase goes on
            self.failed[kind] += 1
            self.errors[type(exc).__name__] += 1
            return None

    def sample(self, client: Any, app: Any, threads: list[str]) -> None:
        stats = client.stats()
        self.handles_max = max(self.handles_max, stats.handles_live)
        self.blocks_max = max(self.blocks_max, stats.blocks_used - stats.blocks_cache_only)
        self.per_thread_max = max(self.per_thread_max, *(len(app.retained(t)) for t in threads))


def checkpointer_app(client: Any) -> Any:
    """The phase's app, wrapped: reader -> reviewer over the thread's messages, a ``MemorySaver``."""
    from typing import Annotated, TypedDict

    from kvbaton.adapters.langgraph import KvbatonChatModel, wrap
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph, add_messages

    state = TypedDict("State", {"messages": Annotated[list, add_messages]})  # type: ignore[misc]
    model = KvbatonChatModel(client=client, max_tokens=MAX_TOKENS)  # reuse="auto": the adapters' default

    def agent(system: str, ask: str) -> Any:
        def node(values: Any) -> dict[str, Any]:
            question = HumanMessage(ask)
            return {"messages": [question, model.invoke([SystemMessage(system), *values["messages"], question])]}

        return node

    graph = StateGraph(state)
    graph.add_node("reader", agent("You are the reader. Summarize the notes for the team.", "Summarize."))
    graph.add_node("reviewer", agent("You are a strict reviewer of risks and owners.", "Risk?"))
    graph.add_edge(START, "reader")
    graph.add_edge("reader", "reviewer")
    graph.add_edge("reviewer", END)
    return wrap(graph.compile(checkpointer=InMemorySaver()), client)


def checkpointer_phase(threads: int, kv_budget: str, seed: int) -> dict[str, Any]:
    import kvbaton
    from langchain_core.messages import HumanMessage

    server = Server(["--kv-budget", kv_budget, "--max-tokens", "64", "--default-max-tokens", str(MAX_TOKENS)])
    tally = _Pressure()
    names = [f"soak-thread-{i}" for i in range(threads)]
    t0 = time.monotonic()
    try:
        server.start()
        client = kvbaton.connect(server.url, timeout=300.0)
        try:
            app = checkpointer_app(client)
            pool = client.stats().blocks_total
            unrelated = client.tokenize(document(40 * pool, seed=seed + 1))
            size = int(pool * UNRELATED_SHARE) * 16 - 8  # with max_tokens, just under the share in blocks
            with rss_samples(server) as samples:
                for i, name in enumerate(names):
                    notes = f"Notes:\n{document(NOTES_WORDS, seed=seed + 100 + i)}"
                    tally.attempt("turn", functools.partial(app.invoke, {"messages": [HumanMessage(notes)]},
                                                            {"configurable": {"thread_id": name}}))
                    if i >= REVISIT_EVERY:  # a thread whose handles were spilled long ago takes its next turn
                        tally.attempt("turn", functools.partial(
                            app.invoke, {"messages": [HumanMessage("Who owns it?")]},
                            {"configurable": {"thread_id": names[i - REVISIT_EVERY]}}))
                    tally.sample(client, app, names[: i + 1])
                    prompt = unrelated[(i * size) % max(1, len(unrelated) - size):][:size]
                    done = tally.attempt("unrelated", functools.partial(client.complete, prompt, max_tokens=MAX_TOKENS))
                    if done is not None:
                        client.release(done.handle)
            stats = client.stats()
            for name in names:
                app.release(name)
            left = client.stats().handles_live
        finally:
            client.close()
        leaked = leaks(server.url, (None,))
        server.stop()
        logs = server.output()
    finally:
        server.close()
    return {"phase": "checkpointer", "threads": threads, "seconds": round(time.monotonic() - t0, 1),
            "kv_budget": kv_budget, "pool_blocks": pool, "unrelated_blocks": -(-(size + MAX_TOKENS) // 16),
            "requests": dict(tally.requests), "errors": dict(tally.errors), "dropped_streams": 0,
            "turns_failed": tally.failed["turn"], "unrelated_failed": tally.failed["unrelated"],
            "max_retained_handles": app.max_retained_handles, "retained_handles_per_thread_max": tally.per_thread_max,
            "handles_live_max": tally.handles_max, "retained_blocks_max": tally.blocks_max,
            "handles_spilled": stats.cache.handles_spilled if stats.cache is not None else None,
            "handles_left_after_release": left, **rss_fields(samples), **leaked, "server_log_tail": logs[-LOG_TAIL:]}


def run(duration: float = 120.0, clients: int = 64, kv_budget: str = "96MiB", tier_mib: int = 24,
        cluster: bool = True, seed: int = 0, checkpointer_threads: int = CHECKPOINTER_THREADS,
        checkpointer_kv_budget: str = CHECKPOINTER_KV_BUDGET, volume_duration: float | None = 600.0,
        volume_mib: int = 12, kernel_build: bool = True) -> dict[str, Any]:
    """Every phase; ``volume_duration`` None skips the small-volume one, ``kernel_build`` False the first."""
    phases = [soak_kernels.kernel_build_phase(max_tokens=MAX_TOKENS)] if kernel_build else []
    phases.append(persistent_phase(clients, duration, kv_budget, tier_mib, seed))
    if volume_duration:
        phases.append(soak_persist.volume_phase(min(clients, 32), volume_duration, "48 blocks", volume_mib, seed))
    if cluster:
        phases.append(cluster_phase(max(clients // 4, 2), max(duration / 2, 10.0), kv_budget, seed))
    if checkpointer_threads > 0:
        phases.append(checkpointer_phase(checkpointer_threads, checkpointer_kv_budget, seed))
    return {"benchmark": "soak", "duration_s": duration, "clients": clients, "kv_budget": kv_budget,
            "tier_mib": tier_mib, "max_tokens": MAX_TOKENS, "drop_rate": DROP_RATE,
            "checkpointer_threads": checkpointer_threads, "checkpointer_kv_budget": checkpointer_kv_budget,
            "volume_duration_s": volume_duration, "volume_mib": volume_mib, "rows": phases}


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:+.0f} MiB" if value < 0 or value > 0 else "0 MiB"


def _growth(row: dict[str, Any]) -> str:
    late = row.get("rss_growth_second_half_bytes")  # records before the samples have only the total
    return _mib(row["rss_growth_bytes"]) + ("" if late is None else f" ({_mib(late)})")


def table(payload: dict[str, Any]) -> str:
    """One row per phase: load, errors by class, leaks after ``release_all``, RSS growth, and what the
    phase is about: recovery after the restart, the worker kill, or (the checkpointer app) the unrelated
    requests that failed and the memory the threads retained."""
    pressure = any(r["phase"] == "checkpointer" for r in payload["rows"])
    last = "restart / worker kill" + (" / pool pressure" if pressure else "")
    if any(r["phase"] == "kernel_build" for r in payload["rows"]):
        last = "start after a killed build / " + last
    columns = ["phase", "clients x s", "requests", "errors by class", "dropped streams", "leaked handles",
               "leaked blocks", "RSS growth (2nd half)", last]
    rows = []
    for r in payload["rows"]:
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "none"
        if r["phase"] == "kernel_build":
            phase, load, extra = soak_kernels.row(r)
        elif r["phase"] == "persistent":
            extra = f"{r['handles_recovered']} of {r['handles_kept']}"
            phase = f"one device, --persist, tier on {r['tier_fs']} ({r.get('tier_errors', '?')} tier errors)"
            load = f"{r['clients']} x {r['seconds']:g}"
        elif r["phase"] == "small-volume":
            phase, extra = soak_persist.describe(r)
            load = f"{r['clients']} x {r['seconds']:g}"
        elif r["phase"] == "checkpointer":
            extra = (f"unrelated failed: {r['unrelated_failed']} of {r['requests'].get('unrelated', 0)}; retained max: "
                     f"{r['retained_handles_per_thread_max']} handles/thread (bound {r['max_retained_handles']}), "
                     f"{r['handles_live_max']} handles, {r['retained_blocks_max']} of {r['pool_blocks']} blocks; "
                     f"{r['handles_spilled']} spills")
            phase = f"checkpointer app, {r['pool_blocks']}-block pool, {r['unrelated_blocks']}-block unrelated requests"
            load = f"{r['threads']} threads x {r['seconds']:g}"
        else:
            extra = f"worker killed: {r['workers_killed']}, healthy after: {r['healthy_after']}"
            phase = "--devices cpu,cpu, one worker SIGKILLed"
            load = f"{r['clients']} x {r['seconds']:g}"
        rows.append([phase, load, sum(r["requests"].values()), errors,
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
    parser.add_argument("--volume-duration", type=float, default=600.0,
                        help="seconds of load in the small-volume phase (default 600; 20 with --quick)")
    parser.add_argument("--volume-mib", type=int, default=12, help="size of its volume in MiB (default 12)")
    parser.add_argument("--no-volume", action="store_true", help="skip the small-volume phase")
    parser.add_argument("--checkpointer-threads", type=int, default=CHECKPOINTER_THREADS,
                        help=f"threads of the checkpointer app in phase 3 (default {CHECKPOINTER_THREADS}; "
                        f"{QUICK_CHECKPOINTER_THREADS} with --quick)")
    parser.add_argument("--checkpointer-kv-budget", default=CHECKPOINTER_KV_BUDGET,
                        help=f"the phase 3 server's KV pool (default {CHECKPOINTER_KV_BUDGET!r})")
    parser.add_argument("--no-checkpointer", action="store_true", help="skip phase 3 (the checkpointer app)")
    parser.add_argument("--no-kernel-build", action="store_true", help="skip phase 0 (a kernel build killed midway)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 8 clients for 6 s, the small volume for 20 s, no multi-device phase, "
                        "4 checkpointer threads")
    record.add_arguments(parser, "soak")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.clients, args.no_cluster = min(args.duration, 6.0), min(args.clients, 8), True
        args.volume_duration = min(args.volume_duration, 20.0)
        args.checkpointer_threads = min(args.checkpointer_threads, QUICK_CHECKPOINTER_THREADS)
    if args.no_checkpointer:
        args.checkpointer_threads = 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # A SIGTERM (timeout, CI) unwinds like Ctrl-C: servers stopped, the tmpfs unmounted.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    args.quick_record = args.quick_record or args.quick
    with record.Recording.from_args("soak", args, argv) as rec:
        payload = run(args.duration, args.clients, args.kv_budget, args.tier_mib, not args.no_cluster, args.seed,
                      args.checkpointer_threads, args.checkpointer_kv_budget,
                      None if args.no_volume else args.volume_duration, args.volume_mib, not args.no_kernel_build)
        print(table(payload))
        print(json.dumps({r["phase"]: {k: r[k] for k in ("leaked_handles", "leaked_blocks")} for r in payload["rows"]}))
        print(f"\nwritten: {rec.write(payload)}")
