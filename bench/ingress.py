"""Several ingresses over one cluster: the same requests through one server and through two.

Two CPU workers per cluster, on a local Ray cluster this benchmark starts (``ray.cluster_utils``), serve
the same requests three ways, all running at once (so that the sides alternate within each repeat):

(a) ``own control``: ``kvbaton serve --devices cpu,cpu`` (the default: the control in the server's process);
(b) ``shared control``: ``kvbaton serve --devices cpu,cpu --cluster-name`` on another two workers (the
    control a Ray actor: each request opens and ends a ticket with actor calls);
(c) ``two servers``: (b)'s cluster through (b)'s server and a ``kvbaton serve --attach`` beside it, the
    clients split between them.

Two workloads, every repeat, the sides in turn (each with contexts of its own, so that no side finds
another's prefix in a cache):

- ``sequential``: one client, ``--small`` small requests in a row (a materialize of a short note, a resume
  of one token, the release of both): the mean time of one such triple: what a shared control's calls add;
- ``concurrent``: ``--agents`` clients at once, each materializing its own ``--context-tokens`` context and
  resuming it for ``--max-tokens`` tokens: wall time of the batch and tokens per second.

On a machine with fewer cores than workers and servers, they all share the cores: (c) against (b) then
says what a second ingress costs or saves on this machine, not what it gives on a cluster of GPU nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbaton import SamplingParams
from kvbaton.bench import record
from kvbaton.bench.common import format_table
from kvbaton.bench.corpus import QUESTIONS, document
from kvbaton.bench.processes import start_kvbaton_serve, stop_process
from kvbaton.bench.spread import cell, measured
from kvbaton.bench.transfer import descendants_cpu_s
from kvbaton.http import HttpClient

SIDES = ("own control", "shared control", "two servers")
STARTUP_TIMEOUT_S = 300.0
CLUSTER_NAME = "bench-ingress"


@contextlib.contextmanager
def servers(kv_budget: str) -> Iterator[dict[str, list[str]]]:
    """Every side's server URLs, on a local Ray cluster of one node with a logical CPU per worker."""
    import ray
    from ray.cluster_utils import Cluster as RayNodes

    os.environ.setdefault("RAY_worker_niceness", "0")  # as kvbaton serve's own Ray: the workers are the work
    nodes = RayNodes(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    procs = []
    try:
        common = ["--ray-address", nodes.address, "--kv-budget", kv_budget]
        own, own_url = start_kvbaton_serve(*common, "--devices", "cpu,cpu", timeout=STARTUP_TIMEOUT_S)
        procs.append(own)
        shared, shared_url = start_kvbaton_serve(*common, "--devices", "cpu,cpu", "--cluster-name", CLUSTER_NAME,
                                                 timeout=STARTUP_TIMEOUT_S)
        procs.append(shared)
        attached, attached_url = start_kvbaton_serve("--ray-address", nodes.address, "--attach", CLUSTER_NAME,
                                                     timeout=STARTUP_TIMEOUT_S)
        procs.append(attached)
        yield {"own control": [own_url], "shared control": [shared_url], "two servers": [shared_url, attached_url]}
        # The Ray workers are this run's grandchildren: their CPU is its own, not other load on the machine.
        record.note_own_cpu(descendants_cpu_s())
    finally:
        for proc in reversed(procs):  # the attached server first, then the cluster it serves
            stop_process(proc, 30)
        if ray.is_initialized():
            ray.shutdown()
        nodes.shutdown()


def sequential(urls: list[str], n: int, seed: int) -> float:
    """Mean seconds of one (materialize, resume 1 token, release) triple, ``n`` in a row, the servers in turn."""
    clients = [HttpClient(u, timeout=600) for u in urls]
    try:
        start = time.perf_counter()
        for i in range(n):
            c = clients[i % len(clients)]
            h = c.materialize(f"Note {seed}-{i}: the meeting moved to room {seed % 97 + i}.")
            r = c.resume(h, " Where?", SamplingParams(max_tokens=1, ignore_eos=True))
            c.release([h, r.handle])
        return (time.perf_counter() - start) / n
    finally:
        for c in clients:
            c.close()


def concurrent(urls: list[str], agents: int, context_tokens: int, max_tokens: int, seed: int) -> tuple[float, int]:
    """Wall seconds of ``agents`` clients at once (each on the next server in turn), and the tokens they ran."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    clients = [HttpClient(urls[i % len(urls)], timeout=600) for i in range(agents)]
    contexts = [document(max(1, round(context_tokens / 1.3)), seed=seed + i) for i in range(agents)]  # ~1.3 tokens a word

    def agent(i: int) -> int:
        c = clients[i]
        h = c.materialize(contexts[i])
        r = c.resume(h, "\n\nQ: " + QUESTIONS[i % len(QUESTIONS)] + "\nA:", params)
        c.release([h, r.handle])
        return r.handle.num_tokens

    try:
        with ThreadPoolExecutor(max_workers=agents) as pool:
            start = time.perf_counter()
            tokens = sum(pool.map(agent, range(agents)))
            return time.perf_counter() - start, tokens
    finally:
        for c in clients:
            c.close()


def run(repeats: int = 3, small: int = 30, agents: int = 8, context_tokens: int = 256, max_tokens: int = 16,
        kv_budget: str = "512MiB") -> dict[str, Any]:
    seq: dict[str, list[float]] = {s: [] for s in SIDES}
    walls: dict[str, list[float]] = {s: [] for s in SIDES}
    tokens: dict[str, int] = {}
    with servers(kv_budget) as urls:
        for s in SIDES:  # every server's first forward, and the first ticket, off the clock
            sequential(urls[s], 2 * len(urls[s]), seed=1)
        for rep in range(repeats):
            for k, s in enumerate(SIDES):
                seed = 1000 * (rep + 1) + 100 * k
                seq[s].append(sequential(urls[s], small, seed))
                wall, tokens[s] = concurrent(urls[s], agents, context_tokens, max_tokens, seed)
                walls[s].append(wall)
    rows = []
    for s in SIDES:
        row: dict[str, Any] = {"side": s, "servers": 2 if s == "two servers" else 1, "tokens": tokens[s]}
        measured(row, "small_s", seq[s])
        measured(row, "wall_s", walls[s])
        row["tokens_per_s"] = tokens[s] / statistics.median(walls[s])
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["small_vs_own"] = row["small_s"] / base["small_s"]
        row["wall_vs_own"] = row["wall_s"] / base["wall_s"]
    return {"workers": 2, "cores": os.cpu_count(), "agents": agents, "context_tokens": context_tokens,
            "max_tokens": max_tokens, "small": small, "repeats": repeats, "rows": rows}


def table(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    text = format_table(
        ["side", "servers", "small request triple ms", "vs own control", f"{payload['agents']} agents at once: wall s",
         "tokens/s", "vs own control"],
        [[r["side"], r["servers"], cell(r, "small_s", 1, 1e3), f"{r['small_vs_own']:.2f}x", cell(r, "wall_s"),
          f"{r['tokens_per_s']:.0f}", f"{r['wall_vs_own']:.2f}x"] for r in rows])
    return (f"Two CPU workers per cluster on {payload['cores']} cores (workers, servers and control share them); "
            f"a small triple: materialize a note, resume 1 token, release both (mean of {payload['small']}); agents: "
            f"{payload['context_tokens']}-token contexts, {payload['max_tokens']} tokens each. Median of "
            f"{payload['repeats']} repeats [min–max]; ratios are ratios of medians.\n\n{text}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvbaton bench ingress", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every side (default 3; all kept)")
    parser.add_argument("--small", type=int, default=30, help="small request triples per round (default 30)")
    parser.add_argument("--agents", type=int, default=8, help="clients at once in the concurrent round (default 8)")
    parser.add_argument("--context-tokens", type=int, default=256, help="each agent's context (default 256)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each agent generates (default 16)")
    parser.add_argument("--kv-budget", default="512MiB", help="each worker's KV pool (default 512MiB)")

    def measure(args: argparse.Namespace) -> dict[str, Any]:
        return run(args.repeats, args.small, args.agents, args.context_tokens, args.max_tokens, args.kv_budget)

    record.measure_and_write(parser, "ingress", argv, measure, table)


QUICK_ARGS = ["--repeats", "1", "--small", "4", "--agents", "2", "--context-tokens", "64", "--max-tokens", "2"]
