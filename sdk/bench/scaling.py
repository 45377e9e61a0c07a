"""Multi-agent scaling: k = 1..16 agents over one shared context, text replay vs KV handles.

For each k, k agents ask different questions about the same context, all at once (one thread
each, so the engine batches them), and generate a few tokens:

(a) text replay: each agent's prompt is context + question, prefilled in full (no prefix cache);
(b) handles: the context is materialized once, forked k ways (zero copy), each agent resumes its fork
    with its question.

Per k: wall time of the whole round (for (b) including the materialize), mean TTFT, tokens
prefilled, and the KV held when every agent has answered (all results alive: the peak of the round).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbaton import SamplingParams
from kvbaton.bench.common import format_table, machine_info, write_results
from kvbaton.bench.corpus import QUESTIONS, document
from tqdm.auto import tqdm

DEFAULT_KS = (1, 2, 4, 8, 16)
QUICK_ARGS = ["--ks", "1", "2", "--context-tokens", "128", "--max-tokens", "2"]


def _round(engine: Any, k: int, context: list[int], questions: list[list[int]], params: SamplingParams,
           handles: bool) -> dict[str, Any]:
    before = engine.stats()
    start = time.perf_counter()
    root = engine.materialize(context) if handles else None
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
        "peak_kv_bytes": after.pool_bytes_used,
        "peak_kv_blocks": after.blocks_used,
    }


def run(ks: tuple[int, ...] = DEFAULT_KS, context_tokens: int = 1024, max_tokens: int = 8) -> dict[str, Any]:
    from kvbaton.backend import Engine

    # No prefix cache: text replay must really re-read the context, as a plain server would.
    engine = Engine(kv_budget="2GiB", prefix_cache=False)
    context = engine.tokenize(document(int(context_tokens * 0.9) + 100, seed=21))[:context_tokens]
    questions = [engine.tokenize(f"\n\nAgent {i + 1}. Question: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:")
                 for i in range(max(ks))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    warm = engine.complete(context[:64], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.release(warm.handle)
    rows = []
    for k in tqdm(ks, desc="scaling", unit="k"):
        text = _round(engine, k, context, questions, params, handles=False)
        kv = _round(engine, k, context, questions, params, handles=True)
        rows.append({
            "agents": k,
            "text_wall_s": text["wall_s"], "handles_wall_s": kv["wall_s"],
            "text_ttft_mean_s": text["ttft_mean_s"], "handles_ttft_mean_s": kv["ttft_mean_s"],
            "text_prefilled": text["tokens_prefilled"], "handles_prefilled": kv["tokens_prefilled"],
            "text_peak_kv_bytes": text["peak_kv_bytes"], "handles_peak_kv_bytes": kv["peak_kv_bytes"],
            "wall_text_over_handles": text["wall_s"] / kv["wall_s"],
            "kv_text_over_handles": text["peak_kv_bytes"] / max(kv["peak_kv_bytes"], 1),
        })
    assert engine.stats().blocks_used == 0
    return {"benchmark": "scaling", "model": engine.loaded.name, "context_tokens": len(context),
            "max_tokens": max_tokens, "machine": machine_info(), "rows": rows}


def table(payload: dict[str, Any]) -> str:
    mib = 1024 * 1024
    columns = ["agents", "text s", "handles s", "speedup", "text TTFT s", "handles TTFT s", "text prefilled",
               "handles prefilled", "text KV MiB", "handles KV MiB", "KV ratio"]
    rows = [[r["agents"], r["text_wall_s"], r["handles_wall_s"], f"{r['wall_text_over_handles']:.1f}x",
             r["text_ttft_mean_s"], r["handles_ttft_mean_s"], r["text_prefilled"], r["handles_prefilled"],
             r["text_peak_kv_bytes"] / mib, r["handles_peak_kv_bytes"] / mib, f"{r['kv_text_over_handles']:.1f}x"]
            for r in payload["rows"]]
    return format_table(columns, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvbaton bench scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=list(DEFAULT_KS), help="agent counts (default 1 2 4 8 16)")
    parser.add_argument("--context-tokens", type=int, default=1024, help="shared context length (default 1024)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens each agent generates (default 8)")
    parser.add_argument("--results-dir", default="results", help="where scaling.json is written")
    args = parser.parse_args(argv)
    payload = run(tuple(args.ks), args.context_tokens, args.max_tokens)
    print(table(payload))
    print(f"\nwritten: {write_results(args.results_dir, 'scaling', payload)}")
