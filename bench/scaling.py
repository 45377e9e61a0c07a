"""Multi-agent scaling: k = 1..16 agents over one shared context, text replay vs KV handles.

For each k, k agents ask different questions about the same context, all at once (one thread
each, so the engine batches them), and generate a few tokens:

(a) text replay, prefix cache off: each agent's prompt is context + question, prefilled in full;
(a') text replay, prefix cache on (``cached``): the same prompts on an engine with its prefix cache on
    (the default; the baseline of a prefix-caching server), the cache flushed before the round; one
    request with the context goes first and leaves it in the cache, as (b)'s materialize leaves it in
    a handle, then the k prompts at once;
(b) handles: the context is materialized once, forked k ways (zero copy), each agent resumes its fork
    with its question.

Per k, over ``--repeats`` rounds of each (median [min–max]; every repeat in the record): wall time
of the whole round (for (b) including the materialize), mean TTFT, tokens prefilled, and KV two
ways: ``held`` is the pool's blocks in use when every agent has answered (block arithmetic:
blocks x bytes per block, all results alive), ``peak`` the pool high-water mark sampled every 50 ms
while the round ran (measured; it also sees blocks freed before the end).

With ``--workers N ...`` (e.g. 1 2 3), also the throughput of N CPU workers against one on the Ray
backend (:mod:`kvbaton.backend.cluster`, a private Ray instance, or ``--ray-address``): the same batch
of ``--worker-agents`` requests (each its own context of ``--context-tokens`` tokens and
``--max-tokens`` tokens generated, all sent at once) on a cluster of N workers, each with
``cores // N`` torch threads (at least one). Per N: wall time of the batch (median [min–max] over
``--repeats``), tokens per second (prompt and generated), and the speed-up against one worker. On a
machine with fewer cores than workers the workers share them: the ratio then says what the backend
costs, not what N devices give.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbaton import SamplingParams
from kvbaton.bench import record
from kvbaton.bench.common import NOT_MEASURED, alternating, format_table
from kvbaton.bench.corpus import QUESTIONS, document
from kvbaton.bench.spread import cell, measured
from tqdm.auto import tqdm

DEFAULT_KS = (1, 2, 4, 8, 16)
QUICK_ARGS = ["--ks", "1", "2", "--context-tokens", "128", "--max-tokens", "2", "--repeats", "1"]
MEASURED = ("wall_s", "ttft_mean_s", "peak_kv_bytes")


def _round(engine: Any, k: int, context: list[int], questions: list[list[int]], params: SamplingParams,
           handles: bool, cached: bool = False) -> dict[str, Any]:
    if cached:
        engine.flush_cache()  # every round starts cold, as the others do
    before = engine.stats()
    with record.PeakSampler({"pool": record.pool_bytes(engine)}) as sampled:
        start = time.perf_counter()
        root = engine.materialize(context) if handles else None
        if cached:  # the context's first request: afterwards the cache holds it
            engine.release(engine.complete(context, SamplingParams(max_tokens=1)).handle)
        forks = engine.fork(root, k) if root is not None else [None] * k

        def agent(i: int) -> Any:
            if forks[i] is not None:
                return engine.resume(forks[i], questions[i], params)
            return engine.complete(context + questions[i], params)

        with ThreadPoolExecutor(max_workers=k) as pool:
            results = list(pool.map(agent, range(k)))
        wall = time.perf_counter() - start
        after = engine.stats()
    engine.release([r.handle for r in results] + ([root, *forks] if root is not None else []))
    return {
        "wall_s": wall,
        "ttft_mean_s": statistics.fmean(r.timings.ttft_s for r in results),
        "tokens_prefilled": after.tokens_prefilled - before.tokens_prefilled,
        "held_kv_bytes": after.pool_bytes_used,
        "held_kv_blocks": after.blocks_used,
        "peak_kv_bytes": sampled.total,
    }


def run(ks: tuple[int, ...] = DEFAULT_KS, context_tokens: int = 1024, max_tokens: int = 8,
        repeats: int = 3, cached: bool = True) -> dict[str, Any]:
    from kvbaton.backend import Engine

    # No prefix cache: text replay must really re-read the context, as a plain server would.
    engine = Engine(kv_budget="2GiB", prefix_cache=False)
    record.watch_kv("engine", record.pool_bytes(engine))
    # (a'): the same model on an engine with its prefix cache on, as prefix-caching servers run.
    cache_engine = Engine(kv_budget="2GiB") if cached else None
    if cache_engine is not None:
        record.watch_kv("prefix-cache engine", record.pool_bytes(cache_engine))
    context = engine.tokenize(document(int(context_tokens * 0.9) + 100, seed=21))[:context_tokens]
    questions = [engine.tokenize(f"\n\nAgent {i + 1}. Question: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:")
                 for i in range(max(ks))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    warm = engine.complete(context[:64], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.release(warm.handle)
    rows = []
    for k in tqdm(ks, desc="scaling", unit="k"):
        sides = {
            "text": lambda: _round(engine, k, context, questions, params, handles=False),
            "handles": lambda: _round(engine, k, context, questions, params, handles=True),
        }
        if cache_engine is not None:
            sides["cached"] = lambda k=k: _round(cache_engine, k, context, questions, params, handles=False,
                                                 cached=True)
        runs = alternating(repeats, sides)
        row: dict[str, Any] = {"agents": k}
        for side, rounds in runs.items():
            for key in MEASURED:
                measured(row, f"{side}_{key}", [r[key] for r in rounds])
            last = rounds[-1]  # deterministic: the same in every repeat
            row[f"{side}_prefilled"] = last["tokens_prefilled"]
            row[f"{side}_held_kv_bytes"] = last["held_kv_bytes"]
            row[f"{side}_held_kv_blocks"] = last["held_kv_blocks"]
        row["wall_text_over_handles"] = row["text_wall_s"] / row["handles_wall_s"]
        row["kv_text_over_handles"] = row["text_peak_kv_bytes"] / max(row["handles_peak_kv_bytes"], 1)
        if "cached" in runs:
            row["wall_cached_over_handles"] = row["cached_wall_s"] / row["handles_wall_s"]
            row["kv_cached_over_handles"] = row["cached_peak_kv_bytes"] / max(row["handles_peak_kv_bytes"], 1)
        rows.append(row)
    assert engine.stats().blocks_used == 0
    if cache_engine is not None:
        cache_engine.close()
    return {"benchmark": "scaling", "model": engine.loaded.name, "context_tokens": len(context),
            "max_tokens": max_tokens, "repeats": repeats, "bytes_per_block": engine.stats().bytes_per_block,
            "rows": rows}


def workers_phase(ns: tuple[int, ...], agents: int, context_tokens: int, max_tokens: int, repeats: int,
                  ray_address: str | None = None) -> list[dict[str, Any]]:
    """The same batch of requests on Ray clusters of N CPU workers (see the module docstring)."""
    from kvbaton.backend.cluster import Cluster
    from kvbaton.bench.transfer import descendants_cpu_s

    cores = os.cpu_count() or 1
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    for n in tqdm(ns, desc="workers", unit="N"):
        threads = max(1, cores // n)
        with Cluster(["cpu"] * n, engine_options={"kv_budget": "512MiB", "prefix_cache": False}, calibrate=False,
                     worker_threads=threads, ray_address=ray_address) as cluster:
            prompts = [cluster.tokenize(document(int(context_tokens * 0.9) + 100, seed=100 + i))[:context_tokens]
                       for i in range(agents)]
            with ThreadPoolExecutor(max_workers=max(n, agents)) as pool:
                warm = list(pool.map(lambda i: cluster.complete(prompts[i][:64], SamplingParams(max_tokens=2)),
                                     range(n)))  # every worker's first forward, off the clock
                cluster.release([r.handle for r in warm])
                walls = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    results = list(pool.map(lambda p: cluster.complete(p, params), prompts))
                    walls.append(time.perf_counter() - start)
                    cluster.release([r.handle for r in results])
            per_worker = {w.rank: w.stats.tokens_prefilled for w in cluster.stats().cluster.workers if w.stats}
            record.note_own_cpu(descendants_cpu_s())  # the workers' CPU is this run's, not other load
        row: dict[str, Any] = {"workers": n, "threads_per_worker": threads, "agents": agents,
                               "tokens": agents * (context_tokens + max_tokens),
                               "prefilled_per_worker": per_worker}
        measured(row, "wall_s", walls)
        row["tokens_per_s"] = row["tokens"] / row["wall_s"]
        rows.append(row)
    base = next((r for r in rows if r["workers"] == 1), None)
    for r in rows:
        r["speedup_vs_1"] = base["wall_s"] / r["wall_s"] if base is not None else None
    return rows


def workers_table(payload: dict[str, Any]) -> str:
    rows = payload.get("workers_rows") or []
    if not rows:
        return ""
    text = format_table(
        ["workers", "threads each", "agents", "wall s", "tokens/s", "vs 1 worker", "prefilled per worker"],
        [[r["workers"], r["threads_per_worker"], r["agents"], cell(r, "wall_s"), f"{r['tokens_per_s']:.0f}",
          "-" if r["speedup_vs_1"] is None else f"{r['speedup_vs_1']:.2f}x",
          " / ".join(str(v) for v in r["prefilled_per_worker"].values())] for r in rows])
    return (f"\n\nN CPU workers on the Ray backend against one ({payload.get('cores', '?')} cores; the workers "
            f"share them):\n\n{text}")


def has_cached(payload: dict[str, Any]) -> bool:
    """Whether the record measured text replay with the prefix cache on (older records did not)."""
    return all("cached_wall_s" in r for r in payload["rows"])


def table(payload: dict[str, Any]) -> str:
    """Text replay without a prefix cache ("text"), with it ("text+cache", where measured), and handles."""
    mib = 1024 * 1024
    cached = has_cached(payload)
    sides = ["text", *(["cached"] if cached else []), "handles"]
    label = {"text": "text", "cached": "text+cache", "handles": "handles"}
    columns = ["agents", *(f"{label[s]} s" for s in sides), "vs text", *(["vs text+cache"] if cached else []),
               *(f"{label[s]} TTFT s" for s in sides), *(f"{label[s]} prefilled" for s in sides),
               *(f"{label[s]} peak KV MiB" for s in sides), "peak KV vs text",
               *(["peak KV vs text+cache"] if cached else []),
               "held at end MiB (" + " / ".join(label[s] for s in sides) + ")"]
    rows = [[r["agents"], *(cell(r, f"{s}_wall_s") for s in sides), f"{r['wall_text_over_handles']:.1f}x",
             *([f"{r['wall_cached_over_handles']:.2f}x"] if cached else []),
             *(cell(r, f"{s}_ttft_mean_s") for s in sides), *(r[f"{s}_prefilled"] for s in sides),
             *(cell(r, f"{s}_peak_kv_bytes", 1, 1 / mib) for s in sides), f"{r['kv_text_over_handles']:.1f}x",
             *([f"{r['kv_cached_over_handles']:.2f}x"] if cached else []),
             " / ".join(f"{r[f'{s}_held_kv_bytes'] / mib:.1f}" for s in sides)]
            for r in payload["rows"]]
    text = format_table(columns, rows)
    note = ("text: text replay on an engine without a prefix cache; text+cache: the same on an engine with its prefix "
            "cache on, the context's first request ahead of the agents'; vs: that side's time or peak KV over "
            "handles'.")
    if not cached:
        note = (f"text: text replay on an engine without a prefix cache; vs: its time or peak KV over handles'. Text "
                f"replay with the prefix cache on, the baseline of a prefix-caching server: {NOT_MEASURED}.")
    return f"{text}\n\n{note}{workers_table(payload)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvbaton bench scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=list(DEFAULT_KS), help="agent counts (default 1 2 4 8 16)")
    parser.add_argument("--context-tokens", type=int, default=1024, help="shared context length (default 1024)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens each agent generates (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per k and side (default 3; all kept)")
    parser.add_argument("--no-cached", action="store_true",
                        help="skip text replay on an engine with its prefix cache on")
    parser.add_argument("--workers", type=int, nargs="*", default=[],
                        help="also N CPU workers on the Ray backend against one, for each N given (e.g. 1 2 3)")
    parser.add_argument("--worker-agents", type=int, default=6, help="requests in the --workers batch (default 6)")
    parser.add_argument("--ray-address", default=None, help="--workers on this Ray cluster (default: a private one)")

    def both(args: argparse.Namespace) -> dict[str, Any]:
        payload = run(tuple(args.ks), args.context_tokens, args.max_tokens, args.repeats, cached=not args.no_cached)
        if args.workers:
            payload["cores"] = os.cpu_count()
            payload["workers_rows"] = workers_phase(tuple(args.workers), args.worker_agents, args.context_tokens,
                                                    args.max_tokens, args.repeats, args.ray_address)
        return payload

    record.measure_and_write(parser, "scaling", argv, both, table)
