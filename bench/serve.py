"""Serving throughput and TTFT at several concurrency levels: handle reuse vs text replay with and
without the server's prefix cache, one run.

A real ``kvbaton serve`` process on loopback; HTTP clients in threads. Workload: agents with
different questions over one shared context (system prompt with a document). Three servers, one
after the other (``reuse`` in the rows):

- ``on``: the shared context is materialized once per level (untimed); every request passes its
  handle (and the server's prefix cache is on).
- ``off``: the server runs with ``--no-prefix-cache`` and requests carry only text, so every
  request prefills the whole context (text replay).
- ``cache``: the server with its prefix cache on (the default; what a user of a prefix-caching
  server has) and requests carrying only text; one text request with the context goes first in
  each level (untimed, as ``on``'s materialize), so the context is cached.

TTFT is measured on the client: request sent to first streamed chunk received. Each level runs
``--repeats`` times on the same server; the record keeps every repeat's req/s, tokens/s, p50 and
p99 TTFT, tables show median [min–max], ratios are ratios of medians. The engine lives in the
server process, so the record's ``peak_kv_bytes`` is not sampled; ``server_peak_rss_bytes`` is
each server's peak RSS (``VmHWM``, read before it is stopped).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time
from typing import Any

from kvbaton.bench import record
from kvbaton.bench.common import NOT_MEASURED, format_table, parallel, timed
from kvbaton.bench.corpus import QUESTIONS, document
from kvbaton.bench.processes import start_kvbaton_serve
from kvbaton.bench.spread import cell, measured
from tqdm.auto import tqdm

MODES = ("on", "off", "cache")  # handle reuse; text, no prefix cache; text, prefix cache on
LABELS = {"on": "handle (+ prefix cache)", "off": "text, no prefix cache", "cache": "text, prefix cache on"}


def _start_server(prefix_cache: bool, kv_budget: str) -> tuple[subprocess.Popen[bytes], str]:
    return start_kvbaton_serve("--kv-budget", kv_budget, *([] if prefix_cache else ["--no-prefix-cache"]))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _level(url: str, clients: int, requests: int, system: dict[str, str], mode: str,
           max_tokens: int) -> dict[str, Any]:
    import kvbaton

    setup = kvbaton.connect(url)
    shared = setup.materialize(setup.chat_tokens([system], add_generation_prompt=False)) if mode == "on" else None
    if mode == "cache":  # the context's first request, untimed: afterwards the server's cache holds it
        # (a question none of the timed requests asks: only the shared context is cached by it)
        first = setup.generate([system, {"role": "user", "content": "What are these notes about?"}], max_tokens=1)
        setup.release(first.handle)
    ttfts: list[float] = []
    lock = threading.Lock()
    counter = iter(range(requests))
    errors: list[BaseException] = []

    def client_loop(index: int) -> None:
        client = kvbaton.connect(url, timeout=600)
        try:
            for i in counter:
                messages = [system, {"role": "user", "content": QUESTIONS[(index + i) % len(QUESTIONS)]}]
                start = time.perf_counter()
                stream = client.generate_stream(messages, handle=shared, agent=f"agent{index % 8}",
                                                max_tokens=max_tokens, ignore_eos=True)
                first = None
                for _ in stream:
                    if first is None:
                        first = time.perf_counter() - start
                assert stream.result is not None and first is not None
                client.release(stream.result.handle)
                with lock:
                    ttfts.append(first)
        except BaseException as exc:  # reported after the run
            errors.append(exc)
        finally:
            client.close()

    elapsed, _ = timed(lambda: parallel([lambda i=i: client_loop(i) for i in range(clients)]))
    if shared is not None:
        setup.release(shared)
    setup.close()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]!r}")
    return {
        "clients": clients,
        "requests": len(ttfts),
        "requests_per_s": len(ttfts) / elapsed,
        "tokens_per_s": len(ttfts) * max_tokens / elapsed,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": _percentile(ttfts, 0.99),
    }


MEASURED = ("requests_per_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s")


def run(levels: tuple[int, ...] = (1, 8, 32), context_words: int = 400, max_tokens: int = 8,
        kv_budget: str = "1GiB", repeats: int = 3, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    system = {"role": "system", "content": "You answer questions about these meeting notes.\n" + document(context_words)}
    rows = []
    server_rss: dict[str, int | None] = {}
    for mode in modes:
        proc, url = _start_server(mode != "off", kv_budget)
        try:
            for clients in tqdm(levels, desc=f"serve reuse={mode}", unit="level"):
                runs = [_level(url, clients, max(8, 2 * clients), system, mode, max_tokens) for _ in range(repeats)]
                row: dict[str, Any] = {"reuse": mode, "clients": clients, "requests": runs[0]["requests"]}
                for key in MEASURED:
                    measured(row, key, [r[key] for r in runs])
                rows.append(row)
        finally:
            server_rss[mode] = record.vm_hwm_bytes(proc.pid)
            proc.terminate()
            proc.wait(timeout=30)
    by = {(r["reuse"], r["clients"]): r for r in rows}
    for clients in levels:
        on = by.get(("on", clients))
        for base in ("off", "cache"):  # ratios of the handle rows over each text baseline
            other = by.get((base, clients))
            if on is not None and other is not None:
                on[f"throughput_vs_{base}"] = on["requests_per_s"] / other["requests_per_s"]
                on[f"ttft_p50_vs_{base}"] = other["ttft_p50_s"] / on["ttft_p50_s"]
    return {"benchmark": "serve", "context_words": context_words, "max_tokens": max_tokens, "repeats": repeats,
            "server_peak_rss_bytes": server_rss, "rows": rows}


def has_cached(payload: dict[str, Any]) -> bool:
    """Whether the record measured text with the server's prefix cache on (older records did not)."""
    return any(r["reuse"] == "cache" for r in payload["rows"])


def table(payload: dict[str, Any]) -> str:
    cached = has_cached(payload)
    bases = ["off", *(["cache"] if cached else [])]
    columns = ["requests carry", "clients", "requests", "req/s", "gen tok/s", "TTFT p50 s", "TTFT p99 s",
               *(f"req/s vs {LABELS[b]}" for b in bases), *(f"p50 TTFT vs {LABELS[b]}" for b in bases)]
    def ratio(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.2f}x" if key in r else ""

    rows = [[LABELS.get(r["reuse"], r["reuse"]), r["clients"], r["requests"], cell(r, "requests_per_s"),
             cell(r, "tokens_per_s"), cell(r, "ttft_p50_s"), cell(r, "ttft_p99_s"),
             *(ratio(r, f"throughput_vs_{b}") for b in bases), *(ratio(r, f"ttft_p50_vs_{b}") for b in bases)]
            for r in payload["rows"]]
    text = format_table(columns, rows)
    if not cached:
        text += f"\n\nText requests to a server with its prefix cache on, what users of one have: {NOT_MEASURED}."
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients")
    parser.add_argument("--context-words", type=int, default=400, help="shared document size (~1.3 tokens/word)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-budget", default="1GiB")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each level (default 3; all kept)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="on: handle reuse; off: text, --no-prefix-cache; cache: text, prefix cache on "
                        "(default: all three)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    record.measure_and_write(parser, "serve", argv, lambda args: run(
        tuple(args.levels), args.context_words, args.max_tokens, args.kv_budget, args.repeats,
        tuple(args.modes)), table)
