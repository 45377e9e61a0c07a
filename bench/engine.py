"""Engine speed against plain transformers on the same model and dtype, side by side in one run.

- prefill tokens/s at 512 and 2048 tokens (kvbaton paged prefill vs ``model(input_ids)``); a
  prompt alone goes in chunks of the scheduler's token budget (2048), and one more row prefills
  2048 tokens in the 512-token chunks used while other requests are active;
- decode ms/token at 512 and 4K context (kvbaton vs transformers with its own KV cache);
- decode tokens/s with 1, 8 and 32 concurrent sequences (kvbaton continuous batching; the
  transformers column decodes the same sequences one after another, as a simple loop would);
- the weights-read floor: one row pushed through every decode weight matrix, i.e. what a decode
  step costs in memory traffic alone on this machine (no attention, no framework);
- the prefill matrix-product floor: 2048 rows pushed through every decoder projection as prefill
  runs them (fp32: the fused, oneDNN-packed products), and the share of a 2048-token prefill spent
  there: what is left for attention, norms and the framework.

kvbaton decodes with its fused decode step (``kvbaton.backend.compute.cpu.fast_decode``, on kvbaton's C++
kernels where they build); prefill runs the model's own forward with paged attention. Greedy
agreement is reported against transformers in the same dtype and, for bf16, of both bf16
implementations against fp32 transformers (which one stays closer to full precision).

Every cell alternates kvbaton and transformers ``--repeats`` times (prefill cells twice that); the
record keeps every repeat and the tables show medians with the [min–max] spread (ratios are ratios
of medians). Memory bandwidth on a shared VM drifts between minutes: read the spread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from kvbaton import SamplingParams
from kvbaton.bench import record
from kvbaton.bench.common import format_table, parallel, timed
from kvbaton.bench.corpus import document
from kvbaton.bench.spread import cell, measured
from tqdm.auto import tqdm


def _hf_decode_ms(model: Any, context: list[int], steps: int) -> float:
    with torch.inference_mode():
        out = model(torch.tensor([context]), use_cache=True, logits_to_keep=1)
        cache = out.cache
        token = torch.tensor([[int(out.logits[0, -1].argmax())]])
        out = model(token, cache=cache, use_cache=True)  # warm
        start = time.perf_counter()
        for _ in range(steps):
            out = model(token, cache=out.cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / steps * 1000


def _hf_prefill_s(model: Any, tokens: list[int]) -> float:
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, logits_to_keep=1)
        return time.perf_counter() - start


def _weight_read_ms(engine: Any, repeats: int = 5) -> list[float] | None:
    """ms of each pass of a single row through every decode weight matrix: the memory-bandwidth floor of a step."""
    fast = engine.runner.fast
    if fast is None:
        return None
    mats = fast.weights.matrices()
    rows: dict[int, torch.Tensor] = {}
    runs = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for m in mats:
                width = m.in_features
                x = rows.get(width)
                if x is None:
                    x = rows[width] = torch.ones(1, width, dtype=m.input_dtype)
                m(x)
            runs.append((time.perf_counter() - start) * 1000)
    return runs


def _products_ms(engine: Any, rows: int, repeats: int = 5) -> list[float]:
    """ms of each pass of ``rows`` rows through every decoder projection as prefill runs them: the
    matrix-product floor of a prefill chunk of ``rows`` tokens (no attention, norms or framework)."""
    from kvbaton.backend.compute.cpu import prefill

    products = prefill.projections(engine.loaded.model)
    inputs: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    runs = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first pass warms up
            start = time.perf_counter()
            for product, width, dtype in products:
                x = inputs.get((width, dtype))
                if x is None:
                    g = torch.Generator().manual_seed(width)
                    x = inputs[(width, dtype)] = torch.randn(rows, width, generator=g).to(dtype)
                product(x)
            runs.append((time.perf_counter() - start) * 1000)
    return runs[1:]


def _concurrent_tps(engine: Any, corpus: list[int], k: int, params: SamplingParams) -> float:
    """Tokens/s of ``k`` sequences decoding at once (each its own thread, as concurrent requests)."""
    handles = [engine.materialize(corpus[i * 40 : i * 40 + 128]) for i in range(k)]
    elapsed, results = timed(lambda: parallel([lambda h=h: engine.resume(h, [], params) for h in handles]))
    engine.release(handles + [r.handle for r in results])
    return k * params.max_tokens / elapsed


PRODUCTS_ROWS = 2048  # the prefill chunk of a prompt alone (the scheduler's token budget)


def run(dtypes: tuple[str, ...] = ("float32", "bfloat16"), steps: int = 24, repeats: int = 2,
        concurrency: tuple[int, ...] = (1, 8, 32)) -> dict[str, Any]:
    from kvbaton.backend import Engine, load_model
    from kvbaton.backend.config import DEFAULT_PREFILL_CHUNK as PREFILL_CHUNK

    rows: list[dict[str, Any]] = []
    agreement: dict[str, float] = {}
    vs_fp32: dict[str, dict[str, float]] = {}
    kernels: dict[str, str] = {}
    reference: list[list[int]] | None = None
    floor: dict[str, float | None] = {}
    floor_runs: dict[str, list[float] | None] = {}
    products_runs: dict[str, list[float]] = {}
    for dtype in dtypes:
        engine = Engine(dtype=dtype, kv_budget="3GiB", prefix_cache=False)
        record.watch_kv(f"engine {dtype}", record.pool_bytes(engine))
        hf = load_model(dtype=dtype, attn_implementation="sdpa").model
        kernels[dtype] = engine.runner.fast.weights.kernels if engine.runner.fast else "model forward"
        corpus = engine.tokenize(document(4000, seed=5))
        params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
        bar = tqdm(total=3 + 2 + len(concurrency), desc=f"engine {dtype}", unit="cell")
        engine.release(engine.materialize(corpus[:64]))
        _hf_prefill_s(hf, corpus[:64])
        # Forwards of at most one prefill chunk: how a prompt goes while other requests are active.
        contended = Engine(dtype=dtype, kv_budget="512MiB", prefix_cache=False, max_batch_tokens=PREFILL_CHUNK)
        cells = [(engine, 512, ""), (engine, 2048, ""), (contended, 2048, f", {PREFILL_CHUNK}-token chunks")]
        for eng, n, label in cells:
            tokens = corpus[:n]
            ours, theirs = [], []
            for _ in range(2 * repeats):  # alternating; short cells, so twice the runs against drift
                ours.append(timed(lambda: eng.release(eng.materialize(tokens)))[0])
                theirs.append(_hf_prefill_s(hf, tokens))
            row = {"dtype": dtype, "metric": f"prefill tok/s @{n}{label}"}
            measured(row, "kvbaton", [n / t for t in ours])
            rows.append(measured(row, "transformers", [n / t for t in theirs]))
            bar.update()
        contended.close()
        # Memory bandwidth on a shared VM drifts: every decode cell alternates kvbaton and transformers
        # `repeats` times, so drift hits both sides alike; every run is kept.
        for n in (512, 4096):
            ours, theirs = [], []
            for _ in range(repeats):
                handle = engine.materialize(corpus[:n])
                result = engine.resume(handle, [], params)
                ours.append((result.timings.total_s - result.timings.ttft_s) / steps * 1000)
                engine.release([handle, result.handle])
                theirs.append(_hf_decode_ms(hf, corpus[:n], steps))
            row = {"dtype": dtype, "metric": f"decode ms/token @{n}"}
            measured(row, "kvbaton", ours)
            rows.append(measured(row, "transformers", theirs))
            bar.update()
        for k in concurrency:
            ours, theirs = [], []
            for _ in range(repeats):
                ours.append(_concurrent_tps(engine, corpus, k, params))
                theirs.append(1000 / _hf_decode_ms(hf, corpus[:128], steps))
            row = {"dtype": dtype, "metric": f"decode tok/s x{k} seqs"}
            measured(row, "kvbaton", ours)
            rows.append(measured(row, "transformers", theirs))
            bar.update()
        floor_runs[dtype] = _weight_read_ms(engine)
        products_runs[dtype] = _products_ms(engine, PRODUCTS_ROWS)
        floor[dtype] = statistics.median(floor_runs[dtype]) if floor_runs[dtype] else None
        prompts = [corpus[300 * i : 300 * i + 200] for i in range(6)]
        ours_tokens = [_engine_greedy(engine, p, steps) for p in prompts]
        hf_tokens = [_hf_greedy(hf, p, steps) for p in prompts]
        agreement[dtype] = _agreement(ours_tokens, hf_tokens)
        if dtype == "float32":
            reference = hf_tokens
        elif reference is not None:  # how close each bf16 implementation stays to fp32
            vs_fp32[dtype] = {"kvbaton": _agreement(ours_tokens, reference),
                              "transformers": _agreement(hf_tokens, reference)}
        bar.close()
        engine.close()
    for row in rows:
        higher_better = "tok/s" in row["metric"]
        row["ratio"] = row["kvbaton"] / row["transformers"] if higher_better else row["transformers"] / row["kvbaton"]
    single = {r["dtype"]: r["kvbaton"] for r in rows if r["metric"] == "decode tok/s x1 seqs"}
    for row in rows:
        if row["metric"].startswith("decode tok/s x"):
            row["vs_one_sequence"] = row["kvbaton"] / single[row["dtype"]]
    return {"benchmark": "engine", "dtypes": list(dtypes), "steps": steps, "repeats": repeats, "rows": rows,
            "greedy_agreement_vs_transformers": agreement, "greedy_agreement_vs_fp32_transformers": vs_fp32,
            "kernels": kernels, "weights_read_floor_ms": floor, "weights_read_floor_runs_ms": floor_runs,
            "prefill_products_rows": PRODUCTS_ROWS, "prefill_products_runs_ms": products_runs}


def _engine_greedy(engine: Any, prompt: list[int], steps: int) -> list[int]:
    result = engine.complete(prompt, SamplingParams(max_tokens=steps, ignore_eos=True))
    engine.release(result.handle)
    return result.token_ids


def _hf_greedy(hf: Any, prompt: list[int], steps: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


def _agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """Share of greedy tokens equal to the reference's before the first difference, over all prompts."""
    same = sum(next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(ours, reference))
    return same / sum(len(y) for y in reference)


def table(payload: dict[str, Any]) -> str:
    columns = ["dtype", "metric", "kvbaton", "transformers", "kvbaton advantage", "vs 1 seq"]
    rows = [[r["dtype"], r["metric"], cell(r, "kvbaton"), cell(r, "transformers"), f"{r['ratio']:.2f}x",
             f"{r['vs_one_sequence']:.2f}x" if "vs_one_sequence" in r else ""] for r in payload["rows"]]
    return format_table(columns, rows)


def notes(payload: dict[str, Any]) -> list[str]:
    """The lines under the table: kernels, greedy agreement, the weights-read floor."""
    out = [f"decode kernels: {payload['kernels']}"]
    for dtype, value in payload["greedy_agreement_vs_transformers"].items():
        out.append(f"greedy agreement with transformers ({dtype}): {value:.1%} of tokens before the first difference")
    for dtype, pair in payload["greedy_agreement_vs_fp32_transformers"].items():
        out.append(f"greedy agreement with fp32 transformers ({dtype}): kvbaton {pair['kvbaton']:.1%}, "
                   f"transformers {pair['transformers']:.1%}")
    for dtype, ms in payload["weights_read_floor_ms"].items():
        if ms is not None:
            runs = (payload.get("weights_read_floor_runs_ms") or {}).get(dtype) or [ms]
            out.append(f"weights-read floor ({dtype}): {ms:.1f} ms per decode step, median of {len(runs)} "
                       f"[{min(runs):.1f}–{max(runs):.1f}] (one row through every decode matrix)")
    rows = payload.get("prefill_products_rows")
    for dtype, runs in (payload.get("prefill_products_runs_ms") or {}).items():
        ms = statistics.median(runs)
        prefill = next((r["kvbaton"] for r in payload["rows"]
                        if r["dtype"] == dtype and r["metric"] == f"prefill tok/s @{rows}"), None)
        share = ("" if prefill is None else
                 f"; prefill @{rows} spends {ms / 1000 / (rows / prefill):.0%} of its time in them")
        out.append(f"prefill matrix-product floor ({dtype}): {ms:.0f} ms for {rows} rows through every decoder "
                   f"projection as prefill runs them, median of {len(runs)} [{min(runs):.0f}–{max(runs):.0f}] "
                   f"({rows / ms * 1000:.0f} tok/s){share}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=24, help="decode steps per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per cell, alternating kvbaton and transformers; all kept, median [min–max] shown")
    record.add_arguments(parser, "engine")
    args = parser.parse_args(argv)
    with record.Recording.from_args("engine", args, argv) as rec:
        payload = run(tuple(args.dtypes), args.steps, repeats=args.repeats, concurrency=tuple(args.concurrency))
        path = rec.write(payload)
    print(table(payload))
    print("\n".join(notes(payload)))
    print(f"\nwritten: {path}")
