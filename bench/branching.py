"""Peak KV vs branch factor: a tree-of-thought search with b branches per level, forks vs copies.

A root context is expanded ``--depth`` times; at each level the current node gets b branches, each
generating a short thought, and the first branch is expanded next. Every branch stays alive until
the end (a search that may backtrack), so the KV held at the end is the search's peak.

(a) copies (text passing), prefix cache off: every branch is its own prompt, path so far + branch
    suffix, prefilled in full, so each branch holds its own copy of the context;
(a') copies, prefix cache on (``cached``): the same prompts on an engine with its prefix cache on (the
    default; the baseline of a prefix-caching server), the cache flushed before the search; one
    request with the root context goes first and leaves it in the cache, as (b)'s materialize leaves
    it in a handle, so the branches find the context cached;
(b) forks: the root is materialized once and each level ``fork``s the current node b ways (zero
    copy); a branch adds only its suffix and thought.

Reported per b, over ``--repeats`` searches of each (median [min–max]; every repeat in the record):
the KV pool's high-water mark sampled every 50 ms during the search (``peak``, measured) and its
ratio; the KV held at the end in blocks and bytes (``held``: block arithmetic, blocks x bytes per
block); the ideal fork footprint (blocks of the context once plus each branch's own blocks, its
first one a copy of the parent's partly filled block); tokens prefilled and wall time.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbaton import SamplingParams
from kvbaton.bench import record
from kvbaton.bench.common import NOT_MEASURED, alternating, format_table
from kvbaton.bench.corpus import document
from kvbaton.bench.spread import cell, measured
from tqdm.auto import tqdm

DEFAULT_BRANCHES = (1, 2, 4, 8, 16)
QUICK_ARGS = ["--branches", "1", "2", "--context-tokens", "96", "--depth", "1", "--max-tokens", "2", "--repeats", "1"]


def _search(engine: Any, b: int, depth: int, context: list[int], params: SamplingParams,
            forks: bool, cached: bool = False) -> dict[str, Any]:
    if cached:
        engine.flush_cache()  # every search starts cold, as the others do
    before = engine.stats()
    sampled = record.PeakSampler({"pool": record.pool_bytes(engine)}).start()
    start = time.perf_counter()
    alive: list[Any] = []
    node = engine.materialize(context) if forks else None
    if cached:  # the root context's first request: afterwards the cache holds it
        engine.release(engine.complete(context, SamplingParams(max_tokens=1)).handle)
    if node is not None:
        alive.append(node)
    path = list(context)
    block = before.block_size
    branch_blocks = 0
    for level in range(depth):
        suffixes = [engine.tokenize(f"\nStep {level + 1}, idea {i + 1}:") for i in range(b)]
        starts = engine.fork(node, b) if node is not None else [None] * b
        alive.extend(h for h in starts if h is not None)

        def branch(i: int, starts: list[Any] = starts, suffixes: list[list[int]] = suffixes,
                   path: list[int] = path) -> Any:
            if starts[i] is not None:
                return engine.resume(starts[i], suffixes[i], params)
            return engine.complete(path + suffixes[i], params)

        with ThreadPoolExecutor(max_workers=b) as pool:
            results = list(pool.map(branch, range(b)))
        alive.extend(r.handle for r in results)
        # each branch copies the parent's partly filled last block (copy-on-write), then adds its own tokens
        partial = len(path) % block
        branch_blocks += sum(-(-(partial + len(s) + len(r.token_ids)) // block) for s, r in zip(suffixes, results))
        path = path + suffixes[0] + results[0].token_ids
        node = results[0].handle if forks else None
    wall = time.perf_counter() - start
    after = engine.stats()
    sampled.stop()
    engine.release(alive)
    ideal = -(-len(context) // block) + branch_blocks  # the context once, then each branch's own blocks
    return {"wall_s": wall, "peak_kv_bytes": sampled.total, "held_kv_bytes": after.pool_bytes_used,
            "kv_blocks": after.blocks_used,
            "tokens_prefilled": after.tokens_prefilled - before.tokens_prefilled, "ideal_fork_blocks": ideal,
            "bytes_per_block": after.bytes_per_block}


def run(branches: tuple[int, ...] = DEFAULT_BRANCHES, context_tokens: int = 1024, depth: int = 2,
        max_tokens: int = 8, repeats: int = 2, cached: bool = True) -> dict[str, Any]:
    from kvbaton.backend import Engine

    engine = Engine(kv_budget="2GiB", prefix_cache=False)
    record.watch_kv("engine", record.pool_bytes(engine))
    # (a'): the same model on an engine with its prefix cache on, as prefix-caching servers run.
    cache_engine = Engine(kv_budget="2GiB") if cached else None
    if cache_engine is not None:
        record.watch_kv("prefix-cache engine", record.pool_bytes(cache_engine))
    context = engine.tokenize(document(int(context_tokens * 0.9) + 100, seed=31))[:context_tokens]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for b in tqdm(branches, desc="branching", unit="b"):
        sides = {
            "copies": lambda: _search(engine, b, depth, context, params, forks=False),
            "forks": lambda: _search(engine, b, depth, context, params, forks=True),
        }
        if cache_engine is not None:
            sides["cached"] = lambda b=b: _search(cache_engine, b, depth, context, params, forks=False, cached=True)
        runs = alternating(repeats, sides)
        row: dict[str, Any] = {"branches": b, "depth": depth}
        for side, searches in runs.items():
            measured(row, f"{side}_peak_kv_bytes", [x["peak_kv_bytes"] for x in searches])
            measured(row, f"{side}_wall_s", [x["wall_s"] for x in searches])
            last = searches[-1]  # deterministic: the same in every repeat
            row[f"{side}_held_kv_bytes"] = last["held_kv_bytes"]
            row[f"{side}_kv_blocks"] = last["kv_blocks"]
            row[f"{side}_prefilled"] = last["tokens_prefilled"]
        row["forks_ideal_blocks"] = runs["forks"][-1]["ideal_fork_blocks"]
        row["kv_copies_over_forks"] = row["copies_peak_kv_bytes"] / max(row["forks_peak_kv_bytes"], 1)
        if "cached" in runs:
            row["kv_cached_over_forks"] = row["cached_peak_kv_bytes"] / max(row["forks_peak_kv_bytes"], 1)
        rows.append(row)
    assert engine.stats().blocks_used == 0
    if cache_engine is not None:
        cache_engine.close()
    return {"benchmark": "branching", "model": engine.loaded.name, "context_tokens": len(context), "depth": depth,
            "max_tokens": max_tokens, "repeats": repeats, "bytes_per_block": engine.stats().bytes_per_block,
            "rows": rows}


def has_cached(payload: dict[str, Any]) -> bool:
    """Whether the record measured copies with the prefix cache on (older records did not)."""
    return all("cached_wall_s" in r for r in payload["rows"])


def table(payload: dict[str, Any]) -> str:
    """Copies without a prefix cache ("copies"), with it ("copies+cache", where measured), and forks."""
    mib = 1024 * 1024
    cached = has_cached(payload)
    sides = ["copies", *(["cached"] if cached else []), "forks"]
    label = {"copies": "copies", "cached": "copies+cache", "forks": "forks"}
    columns = ["branches", *(f"{label[s]} peak KV MiB" for s in sides), "copies / forks",
               *(["copies+cache / forks"] if cached else []),
               "held at end MiB (" + " / ".join(label[s] for s in sides) + ")", "forks blocks", "ideal blocks",
               *(f"{label[s]} prefilled" for s in sides), *(f"{label[s]} s" for s in sides)]
    rows = [[r["branches"], *(cell(r, f"{s}_peak_kv_bytes", 1, 1 / mib) for s in sides),
             f"{r['kv_copies_over_forks']:.1f}x", *([f"{r['kv_cached_over_forks']:.2f}x"] if cached else []),
             " / ".join(f"{r[f'{s}_held_kv_bytes'] / mib:.1f}" for s in sides),
             r["forks_kv_blocks"], r["forks_ideal_blocks"], *(r[f"{s}_prefilled"] for s in sides),
             *(cell(r, f"{s}_wall_s") for s in sides)] for r in payload["rows"]]
    text = format_table(columns, rows)
    note = ("copies: text passing on an engine without a prefix cache; copies+cache: the same on an engine with its "
            "prefix cache on, the root context's first request ahead of the branches'.")
    if not cached:
        note = (f"copies: text passing on an engine without a prefix cache. Copies with the prefix cache on, the "
                f"baseline of a prefix-caching server: {NOT_MEASURED}.")
    return f"{text}\n\n{note}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvbaton bench branching", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--branches", type=int, nargs="+", default=list(DEFAULT_BRANCHES),
                        help="branch factors (default 1 2 4 8 16)")
    parser.add_argument("--depth", type=int, default=2, help="levels expanded (default 2)")
    parser.add_argument("--context-tokens", type=int, default=1024, help="root context length (default 1024)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per thought (default 8)")
    parser.add_argument("--repeats", type=int, default=2, help="searches per b and side (default 2; all kept)")
    parser.add_argument("--no-cached", action="store_true",
                        help="skip copies on an engine with its prefix cache on")
    record.measure_and_write(parser, "branching", argv, lambda args: run(
        tuple(args.branches), args.context_tokens, args.depth, args.max_tokens, args.repeats,
        cached=not args.no_cached), table)
