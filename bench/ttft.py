"""TTFT of text replay vs resuming a handle vs the question-only floor, side by side in one run.

(a) text replay, prefix cache off: dense prefill of context + question, then the first token, on an
    engine without a prefix cache (what a server without prefix caching pays).
(a') text replay, prefix cache on: the same prompt on an engine with its prefix cache on (the
    default), the context sent before (one request with another question, untimed): the baseline a
    user of a prefix-caching server (vLLM, SGLang, kvbaton's own) has. The cache is flushed and warmed
    again before every repeat, so the question itself is never cached.
(b) resume: the context is a handle; prefill only the question behind it, then the first token.
(c) floor: prefill of the question tokens alone plus one decode step (no context at all).
Also shown: plain transformers' forward over context + question (no kvbaton), for reference.
Every cell is timed ``--repeats`` times; the record keeps every repeat, tables show the median
with the [min–max] spread, and the ratios are ratios of medians. ``--no-cached`` leaves (a') out.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from kvbaton import SamplingParams
from kvbaton.bench import record
from kvbaton.bench.common import NOT_MEASURED, format_table, repeat_times
from kvbaton.bench.corpus import QUESTIONS, document
from kvbaton.bench.spread import cell, measured
from tqdm.auto import tqdm

DEFAULT_LENGTHS = (512, 1024, 2048, 4096)


def run(lengths: tuple[int, ...] = DEFAULT_LENGTHS, repeats: int = 3, with_hf: bool = True,
        cached: bool = True) -> dict[str, Any]:
    from kvbaton.backend import Engine, load_model

    # No prefix cache: (a) must really re-read the context, not find it cached from (b)'s handle.
    engine = Engine(kv_budget="2GiB", prefix_cache=False)
    record.watch_kv("engine", record.pool_bytes(engine))
    # (a'): the same model (loaded once per process) on an engine with its prefix cache on, the default.
    cache_engine = Engine(kv_budget="2GiB") if cached else None
    if cache_engine is not None:
        record.watch_kv("prefix-cache engine", record.pool_bytes(cache_engine))
    corpus = engine.tokenize(document(int(max(lengths) * 0.9) + 200, seed=11))
    if len(corpus) < max(lengths):
        raise RuntimeError("corpus too short for the requested context lengths")
    question = engine.tokenize("\n\nQuestion: " + QUESTIONS[0] + "\nAnswer:")
    earlier = engine.tokenize("\n\nQuestion: " + QUESTIONS[1] + "\nAnswer:")  # what warms (a')'s cache
    first = SamplingParams(max_tokens=1, ignore_eos=True)
    two = SamplingParams(max_tokens=2, ignore_eos=True)
    hf = load_model(attn_implementation="sdpa").model if with_hf else None
    release = lambda result: engine.release(result.handle)

    # Warm up allocator and kernels so the first measured row is not penalised.
    warm = engine.materialize(corpus[:64])
    release(engine.resume(warm, question, first))
    engine.release(warm)

    rows = []
    for length in tqdm(lengths, desc="ttft", unit="context"):
        context = corpus[:length]
        handle = engine.materialize(context)
        row: dict[str, Any] = {"context_tokens": length, "question_tokens": len(question)}
        measured(row, "replay_s", repeat_times(lambda: engine.complete(context + question, first), repeats, release))
        measured(row, "resume_s", repeat_times(lambda: engine.resume(handle, question, first), repeats, release))
        measured(row, "floor_s", repeat_times(lambda: engine.complete(question, two), repeats, release))
        row["replay_over_resume"] = row["replay_s"] / row["resume_s"]
        row["resume_over_floor"] = row["resume_s"] / row["floor_s"]
        if cache_engine is not None:
            def warm(previous: Any = None, ctx: list[int] = context) -> None:
                """Only the context in the cache: the last repeat's prompt out, an earlier turn's in."""
                if previous is not None:
                    cache_engine.release(previous.handle)
                cache_engine.flush_cache()
                cache_engine.release(cache_engine.complete(ctx + earlier, first).handle)

            warm()
            measured(row, "replay_cached_s",
                     repeat_times(lambda ctx=context: cache_engine.complete(ctx + question, first), repeats, warm))
            row["replay_cached_over_resume"] = row["replay_cached_s"] / row["resume_s"]
        if hf is not None:
            ids = torch.tensor([context + question])
            with torch.inference_mode():
                measured(row, "hf_dense_prefill_s", repeat_times(lambda: hf(ids, logits_to_keep=1), repeats))
        engine.release(handle)
        rows.append(row)
    assert engine.stats().blocks_used == 0
    if cache_engine is not None:
        cache_engine.close()
    return {"benchmark": "ttft", "model": engine.loaded.name, "dtype": "float32", "repeats": repeats, "rows": rows}


def has_cached(payload: dict[str, Any]) -> bool:
    """Whether the record measured (a'), text replay with the prefix cache on (older records did not)."""
    return all("replay_cached_s" in r for r in payload["rows"])


def table(payload: dict[str, Any]) -> str:
    cached = has_cached(payload)
    columns = ["context", "(a) replay, no prefix cache s", *(["(a') replay, prefix cache on s"] if cached else []),
               "(b) resume s", "(c) floor s", "(a)/(b)", *(["(a')/(b)"] if cached else []), "(b)/(c)"]
    has_hf = all("hf_dense_prefill_s" in r for r in payload["rows"])
    if has_hf:
        columns.append("HF dense s")
    rows = []
    for r in payload["rows"]:
        row = [r["context_tokens"], cell(r, "replay_s"), *([cell(r, "replay_cached_s")] if cached else []),
               cell(r, "resume_s"), cell(r, "floor_s"), f"{r['replay_over_resume']:.1f}x",
               *([f"{r['replay_cached_over_resume']:.2f}x"] if cached else []), f"{r['resume_over_floor']:.2f}x"]
        if has_hf:
            row.append(cell(r, "hf_dense_prefill_s"))
        rows.append(row)
    text = format_table(columns, rows)
    if not cached:
        text += f"\n\n(a') text replay with the prefix cache on, what a prefix-caching server gives: {NOT_MEASURED}."
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench ttft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="context lengths")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per cell (all kept; median and [min–max] reported)")
    parser.add_argument("--no-hf", action="store_true", help="skip the plain-transformers reference column")
    parser.add_argument("--no-cached", action="store_true",
                        help="skip (a'), text replay on an engine with its prefix cache on")
    record.measure_and_write(parser, "ttft", argv, lambda args: run(
        tuple(args.lengths), args.repeats, with_hf=not args.no_hf, cached=not args.no_cached), table)
