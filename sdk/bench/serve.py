"""Serving throughput and TTFT at several concurrency levels, reuse on vs off, one run.

A real ``kvbaton serve`` process on loopback; HTTP clients in threads. Workload: agents with
different questions over one shared context (system prompt with a document).

- reuse on: the shared context is materialized once; every request passes its handle (and the
  server's prefix cache is on).
- reuse off: the server runs with ``--no-prefix-cache`` and requests carry only text, so every
  request prefills the whole context (text replay).

TTFT is measured on the client: request sent to first streamed chunk received. Each level runs
``--repeats`` times on the same server; the record keeps every repeat's req/s, tokens/s, p50 and
p99 TTFT, tables show median [min–max], ratios are ratios of medians. The engine lives in the
server process, so the record's ``peak_kv_bytes`` is not sampled; ``server_peak_rss_bytes`` is
each server's peak RSS (``VmHWM``, read before it is stopped).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from kvbaton.bench import record
from kvbaton.bench.common import format_table, parallel, timed
from kvbaton.bench.corpus import QUESTIONS, document
from kvbaton.bench.spread import cell, measured
from tqdm.auto import tqdm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(reuse: bool, kv_budget: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--port", str(port), "--kv-budget", kv_budget,
           "--log-level", "warning"]
    if not reuse:
        cmd.append("--no-prefix-cache")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvbaton serve exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("kvbaton serve did not become healthy in 180 s")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _level(url: str, clients: int, requests: int, system: dict[str, str], reuse: bool,
           max_tokens: int) -> dict[str, Any]:
    import kvbaton

    setup = kvbaton.connect(url)
    shared = setup.materialize(setup.chat_tokens([system], add_generation_prompt=False)) if reuse else None
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
        kv_budget: str = "1GiB", repeats: int = 3) -> dict[str, Any]:
    system = {"role": "system", "content": "You answer questions about these meeting notes.\n" + document(context_words)}
    rows = []
    server_rss: dict[str, int | None] = {}
    for reuse in (True, False):
        proc, url = _start_server(reuse, kv_budget)
        try:
            for clients in tqdm(levels, desc=f"serve reuse={'on' if reuse else 'off'}", unit="level"):
                runs = [_level(url, clients, max(8, 2 * clients), system, reuse, max_tokens) for _ in range(repeats)]
                row: dict[str, Any] = {"reuse": "on" if reuse else "off", "clients": clients,
                                       "requests": runs[0]["requests"]}
                for key in MEASURED:
                    measured(row, key, [r[key] for r in runs])
                rows.append(row)
        finally:
            server_rss["on" if reuse else "off"] = record.vm_hwm_bytes(proc.pid)
            proc.terminate()
            proc.wait(timeout=30)
    by = {(r["reuse"], r["clients"]): r for r in rows}
    for clients in levels:
        on, off = by[("on", clients)], by[("off", clients)]
        on["throughput_vs_off"] = on["requests_per_s"] / off["requests_per_s"]
        on["ttft_p50_vs_off"] = off["ttft_p50_s"] / on["ttft_p50_s"]
    return {"benchmark": "serve", "context_words": context_words, "max_tokens": max_tokens, "repeats": repeats,
            "server_peak_rss_bytes": server_rss, "rows": rows}


def table(payload: dict[str, Any]) -> str:
    columns = ["reuse", "clients", "requests", "req/s", "gen tok/s", "TTFT p50 s", "TTFT p99 s", "req/s vs off",
               "p50 TTFT vs off"]
    rows = [[r["reuse"], r["clients"], r["requests"], cell(r, "requests_per_s"), cell(r, "tokens_per_s"),
             cell(r, "ttft_p50_s"), cell(r, "ttft_p99_s"),
             f"{r['throughput_vs_off']:.2f}x" if "throughput_vs_off" in r else "",
             f"{r['ttft_p50_vs_off']:.2f}x" if "ttft_p50_vs_off" in r else ""] for r in payload["rows"]]
    return format_table(columns, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients")
    parser.add_argument("--context-words", type=int, default=400, help="shared document size (~1.3 tokens/word)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-budget", default="1GiB")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each level (default 3; all kept)")
    record.add_arguments(parser, "serve")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with record.Recording.from_args("serve", args, argv) as rec:
        payload = run(tuple(args.levels), args.context_words, args.max_tokens, args.kv_budget, args.repeats)
        print(table(payload))
        print(f"\nwritten: {rec.write(payload)}")
