"""Persona-first multi-agent workloads: exact reuse, approximate reuse and text replay side by side.

Every agent puts its own persona (system prompt) first and the shared document after it
(:mod:`kvbaton.bench.workloads`: ``debate``, ``chain``, ``fanout``), so exact prefix reuse finds an
agent's own earlier turns but never another agent's reading of the document; approximate reuse
(``reuse="auto"`` / ``"rotate"``) may place it from another agent's cache, re-aligned to the new
positions (``auto`` also recomputes its most-deviating tokens, or everything when the answer looks
unsure; ``rotate`` does no correction).

Variants, each on the embedded engine, side by side (``alternating`` repeats), per dtype:

- ``exact``: ``client.generate(messages, agent=..., reuse="exact")``: prefix cache, exact only;
- ``auto``: the same with ``reuse="auto"``; ``rotate``: with ``reuse="rotate"``;
- ``text``: text replay: ``client.complete(<the same chat's prompt tokens>)`` on an engine without a
  prefix cache, so every turn prefills everything.

One client per dtype serves exact/auto/rotate (a second one, without a prefix cache, serves text);
every variant and every workload inside it starts cold: the prefix cache flushed, the default anchor
pool cleared, no handle alive. A workload's result handles stay alive until the workload ends (as a
workflow holds them), then all are released. Greedy decoding, EOS ignored: every turn generates
exactly ``--max-tokens`` tokens.

Reported per dtype and variant: end-to-end seconds (min/median/max over ``--repeats``), the share of
prompt tokens reused exactly / approximately / prefilled (from ``Result.timings``, per agent too),
and fidelity against the ``exact`` variant:

- teacher-forced: each approximate variant runs again with every turn given the exact run's prompt
  (its transcript); its first generated token and its greedy tokens are compared with the exact
  run's output of that turn (first-token agreement, mean share of tokens identical before the first
  divergence). ``--tf-passes`` passes, pass ``p`` on documents of seed ``p``; only turns after each
  workload's first count (the first agent has no other agent's cache to reuse): a first-token claim
  needs at least 60 such turns (the default, 3 passes x 21 turns, gives 63);
- free-running: the share of turns whose whole text equals the exact run's (seed 0, first repeat).

KL: on the first teacher-forced pass, every approximated turn's handle (prompt and answer) is
measured with ``fidelity(handle, max_tokens=1)``: KL(dense || approximate) of the next-token
distribution against a dense prefill of the same tokens (untimed; a dense reference per turn costs a
full prefill, so later passes skip it).

Until ``reuse=`` exists on ``Client.generate`` (detected at run time), only ``exact`` and ``text``
run and the record says so.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvbaton import SamplingParams
from kvbaton.bench import record
from kvbaton.bench.common import alternating, format_table
from kvbaton.bench.spread import cell, measured
from kvbaton.bench.workloads import WARMUP_PROMPT, WARMUP_TOKENS, WORKLOADS, Workload, build, run_workload
from tqdm.auto import tqdm

VARIANTS = ("exact", "auto", "rotate", "text")
APPROXIMATE = ("auto", "rotate")
LABELS = {
    "exact": "exact reuse (prefix cache)",
    "auto": "reuse='auto' (re-align, recompute the most-deviating tokens)",
    "rotate": "reuse='rotate' (re-align only)",
    "text": "text replay (no prefix cache)",
}
DEFAULT_DTYPES = ("float32", "bfloat16")
DEFAULT_REPEATS = 2
DEFAULT_TF_PASSES = 3
MIN_TF_TURNS = 60
KV_BUDGET = "4GiB"
KL_NOTE = ("KL(dense || approximate) of the next-token distribution after each approximated turn's prompt and "
           "answer, from `fidelity(handle, max_tokens=1)` (a dense prefill of the same tokens), on the first "
           "teacher-forced pass only (a dense reference per turn costs a full prefill); the time is not counted")


# -- the engine side -----------------------------------------------------------------------------------


def supports_reuse(client: Any) -> bool:
    """Whether ``client.generate`` takes ``reuse=`` (the keyword lands with approximate reuse)."""
    try:
        if "reuse" in inspect.signature(client.generate).parameters:
            return True
    except (TypeError, ValueError):
        pass
    try:  # a keyword taken through **options would show only by working
        probe = client.generate([{"role": "user", "content": "Hi"}], sampling=SamplingParams(max_tokens=1),
                                reuse="exact")
    except Exception:  # noqa: BLE001 - TypeError, or the sampling validator refusing an unknown field
        return False
    client.release(probe.handle)
    return True


def connect(dtype: str, prefix_cache: bool) -> Any:
    """An embedded client of ``dtype``, warmed up with the shared warm-up request."""
    import kvbaton

    client = kvbaton.connect(dtype=dtype, kv_budget=KV_BUDGET, prefix_cache=prefix_cache)
    warm = client.complete(WARMUP_PROMPT, sampling=SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True))
    client.release(warm.handle)
    return client


def cold(client: Any) -> None:
    """Nothing cached, no anchors learned, no handle alive: the start of every variant and workload."""
    engine = client.engine
    engine.flush_cache()
    try:
        engine.anchor_pool().clear()
    except AttributeError:
        pass
    if client.stats().handles_live:
        raise RuntimeError("a handle outlived its workload: variants would not start cold")


def turn_record(result: Any, agent: str, index: int, seconds: float) -> dict[str, Any]:
    """What one turn cost and produced, from its ``Result``."""
    t = result.timings
    approx = int(getattr(t, "tokens_approximate", 0) or 0)
    segments = getattr(result, "segments", None) or []
    return {
        "index": index, "agent": agent, "seconds": seconds, "ttft_s": t.ttft_s,
        "prompt_tokens": t.tokens_reused + t.tokens_prefilled, "reused_exact": t.tokens_reused - approx,
        "reused_approx": approx, "prefilled": t.tokens_prefilled, "generated": t.tokens_generated,
        "exact": bool(getattr(result, "exact", True)),
        "segments": dict(Counter(str(getattr(s, "outcome", "?")) for s in segments)),
        "token_ids": list(result.token_ids), "text": result.text,
    }


def generate_fn(client: Any, variant: str, sampling: SamplingParams, reuse_kw: bool, held: list[Any],
                turns: list[dict[str, Any]], kl: bool = False) -> Callable[[str, list[dict[str, str]]], str]:
    """``generate_fn(agent, messages) -> text`` of one variant; keeps every handle and turn record
    (with ``kl``, the KL of approximate turns against dense prefill, untimed)."""
    def fn(agent: str, messages: list[dict[str, str]]) -> str:
        start = time.perf_counter()
        if variant == "text":
            result = client.complete(client.chat_tokens(messages), sampling=sampling, agent=agent)
        elif reuse_kw:
            result = client.generate(messages, sampling=sampling, agent=agent, reuse=variant)
        else:
            result = client.generate(messages, sampling=sampling, agent=agent)
        seconds = time.perf_counter() - start
        held.append(result.handle)
        turns.append(turn_record(result, agent, len(turns), seconds))
        if kl and not getattr(result, "exact", True):
            t0 = time.perf_counter()
            turns[-1]["kl"] = client.fidelity(result.handle, max_tokens=1).kl_first
            turns[-1]["seconds_kl"] = time.perf_counter() - t0
        return result.text

    return fn


def run_variant(client: Any, variant: str, workloads: Sequence[Workload], sampling: SamplingParams,
                reuse_kw: bool, teachers: dict[str, list[str]] | None = None, kl: bool = False) -> dict[str, Any]:
    """Every workload once with ``variant``, each from a cold engine: seconds and turn records."""
    out: dict[str, Any] = {"variant": variant, "workloads": {}}
    for wl in workloads:
        cold(client)
        held: list[Any] = []
        turns: list[dict[str, Any]] = []
        start = time.perf_counter()
        run_workload(wl, generate_fn(client, variant, sampling, reuse_kw, held, turns, kl),
                     teacher=None if teachers is None else teachers[wl.name])
        # KL measurements are not part of the workload's time.
        seconds = time.perf_counter() - start - sum(t["seconds_kl"] for t in turns if "seconds_kl" in t)
        client.release(held)
        out["workloads"][wl.name] = {"seconds": seconds, "turns": turns}
    out["seconds"] = sum(w["seconds"] for w in out["workloads"].values())
    return out


# -- fidelity and shares -------------------------------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(run: dict[str, Any], reference: dict[str, Any], max_tokens: int) -> list[dict[str, Any]]:
    """Turn by turn against the reference run: first token, greedy prefix, whole text (every turn
    after each workload's first: those are the turns that could reuse another agent's cache)."""
    out = []
    for name, wl in run["workloads"].items():
        ref_turns = reference["workloads"][name]["turns"]
        for mine, ref in zip(wl["turns"], ref_turns, strict=True):
            if mine["index"] == 0:
                continue
            out.append({"workload": name, "index": mine["index"], "agent": mine["agent"],
                        "first_token": mine["token_ids"][:1] == ref["token_ids"][:1],
                        "prefix": common_prefix(mine["token_ids"], ref["token_ids"]) / max_tokens,
                        "same_text": mine["text"] == ref["text"], "approximated": mine["reused_approx"] > 0})
    return out


def agreement(turns: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(turns)
    return {
        "turns": n, "turns_approximated": sum(t["approximated"] for t in turns),
        "first_token": sum(t["first_token"] for t in turns) / n if n else None,
        "prefix": statistics.fmean(t["prefix"] for t in turns) if n else None,
        "same_text": sum(t["same_text"] for t in turns) / n if n else None,
    }


def kl_summary(values: list[float] | None) -> dict[str, Any] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"turns": len(values), "mean": statistics.fmean(values), "median": statistics.median(values),
            "max": ordered[-1], "values": values}


def shares(turns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(t["prompt_tokens"] for t in turns)
    totals = {k: sum(t[k] for t in turns) for k in ("reused_exact", "reused_approx", "prefilled")}
    return {"turns": len(turns), "prompt_tokens": prompt, **totals,
            **{f"{k}_share": v / prompt if prompt else 0.0 for k, v in totals.items()}}


def per_agent(run: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, list[dict[str, Any]]] = {}
    for name, wl in run["workloads"].items():
        for t in wl["turns"]:
            found.setdefault(f"{name}/{t['agent']}", []).append(t)
    return {key: shares(turns) for key, turns in found.items()}


def all_turns(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for wl in run["workloads"].values() for t in wl["turns"]]


# -- the benchmark ---------------------------------------------------------------------------------


def workloads_of(names: Sequence[str], seed: int, quick: bool) -> list[Workload]:
    return [build(name, seed, quick) for name in names]


def run_dtype(dtype: str, names: Sequence[str], repeats: int, tf_passes: int, max_tokens: int, quick: bool,
              variants: Sequence[str]) -> dict[str, Any]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    cached = connect(dtype, prefix_cache=True)
    plain = connect(dtype, prefix_cache=False) if "text" in variants else None
    record.watch_kv(f"engine {dtype}", record.pool_bytes(cached.engine))
    if plain is not None:
        record.watch_kv(f"engine {dtype} text", record.pool_bytes(plain.engine))
    try:
        reuse_kw = supports_reuse(cached)
        chosen = [v for v in variants if v in ("exact", "text") or reuse_kw]
        skipped = [v for v in variants if v not in chosen]
        base = workloads_of(names, 0, quick)
        client_of = {v: plain if v == "text" else cached for v in chosen}
        progress = tqdm(total=repeats * len(chosen), desc=f"agents {dtype}", unit="variant run")

        def side(v: str) -> Callable[[], dict[str, Any]]:
            def go() -> dict[str, Any]:
                out = run_variant(client_of[v], v, base, sampling, reuse_kw)
                progress.update()
                return out
            return go

        runs = alternating(repeats, {v: side(v) for v in chosen})
        progress.close()
        exact_ref = runs["exact"][0]
        tf: dict[str, list[dict[str, Any]]] = {v: [] for v in chosen if v in APPROXIMATE and tf_passes > 0}
        tf_seconds: dict[str, list[float]] = {v: [] for v in tf}
        kls: dict[str, list[float]] = {v: [] for v in tf}
        if tf:
            for p in tqdm(range(tf_passes), desc=f"agents {dtype} teacher-forced", unit="pass"):
                wls = base if p == 0 else workloads_of(names, p, quick)
                ref = exact_ref if p == 0 else run_variant(cached, "exact", wls, sampling, reuse_kw)
                teachers = {name: [t["text"] for t in ref["workloads"][name]["turns"]] for name in names}
                for v in tf:
                    forced = run_variant(cached, v, wls, sampling, reuse_kw, teachers=teachers, kl=p == 0)
                    kls[v] += [t["kl"] for w in forced["workloads"].values() for t in w["turns"] if "kl" in t]
                    tf[v] += [{**c, "pass": p} for c in compare(forced, ref, max_tokens)]
                    tf_seconds[v].append(forced["seconds"])
        rows = []
        for v in chosen:
            first = runs[v][0]
            row: dict[str, Any] = {"dtype": dtype, "variant": v, "label": LABELS[v], "repeats": repeats}
            measured(row, "end_to_end_s", [r["seconds"] for r in runs[v]])
            for name in names:
                measured(row, f"{name}_s", [r["workloads"][name]["seconds"] for r in runs[v]])
            turns = all_turns(first)
            row.update({
                "shares": shares(turns),
                "per_agent": per_agent(first),
                "results_not_exact": sum(not t["exact"] for t in turns),
                "segments": dict(sum((Counter(t["segments"]) for t in turns), Counter())),
                "free_running": agreement(compare(first, exact_ref, max_tokens)),
                "teacher_forced": agreement(tf[v]) if v in tf else None,
                "teacher_forced_turns": tf.get(v),
                "teacher_forced_seconds": tf_seconds.get(v),
                "kl": kl_summary(kls.get(v)),
                "run_detail": first,
            })
            rows.append(row)
        text_row = next((r for r in rows if r["variant"] == "text"), None)
        for r in rows:
            r["speedup_vs_text"] = text_row["end_to_end_s"] / r["end_to_end_s"] if text_row else None
        documents = {wl.name: len(cached.tokenize(wl.document)) for wl in base}
        personas = {wl.name: {a.name: len(cached.tokenize(a.persona)) for a in wl.agents.values()} for wl in base}
        return {"rows": rows, "reuse_supported": reuse_kw, "skipped_variants": skipped,
                "document_tokens": documents, "persona_tokens": personas}
    finally:
        cached.close()
        if plain is not None:
            plain.close()


def run(dtypes: Sequence[str] = DEFAULT_DTYPES, names: Sequence[str] = tuple(WORKLOADS), repeats: int = DEFAULT_REPEATS,
        tf_passes: int = DEFAULT_TF_PASSES, max_tokens: int = 32, quick: bool = False,
        variants: Sequence[str] = VARIANTS) -> dict[str, Any]:
    if "exact" not in variants:
        raise ValueError("the exact variant is the fidelity reference: it always runs")
    per_dtype = {d: run_dtype(d, names, repeats, tf_passes, max_tokens, quick, variants) for d in dtypes}
    first = per_dtype[dtypes[0]]
    wls = workloads_of(names, 0, quick)
    return {
        "benchmark": "agents",
        "dtypes": list(dtypes),
        "workloads": list(names),
        "turns_per_workload": {wl.name: len(wl.turns) for wl in wls},
        "workload_meta": {wl.name: wl.meta for wl in wls},
        "document_tokens": first["document_tokens"],
        "persona_tokens": first["persona_tokens"],
        "max_tokens": max_tokens,
        "repeats": repeats,
        "tf_passes": tf_passes,
        "min_tf_turns": MIN_TF_TURNS,
        "reuse_supported": all(p["reuse_supported"] for p in per_dtype.values()),
        "skipped_variants": sorted({v for p in per_dtype.values() for v in p["skipped_variants"]}),
        "kl": {"measured": True, "reason": KL_NOTE},
        "rows": [r for p in per_dtype.values() for r in p["rows"]],
    }


# -- tables --------------------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def table(payload: dict[str, Any]) -> str:
    names = payload["workloads"]
    columns = ["dtype", "variant", "end-to-end s", "vs text", *(f"{n} s" for n in names), "reused exact",
               "reused approx", "prefilled", "TF 1st token", f"TF {payload['max_tokens']}-token prefix", "TF turns",
               "free-running same text"]
    rows = []
    for r in payload["rows"]:
        s, tf = r["shares"], r.get("teacher_forced")
        rows.append([r["dtype"], r["variant"], cell(r, "end_to_end_s", 2),
                     f"{r['speedup_vs_text']:.2f}x" if r.get("speedup_vs_text") else "-",
                     *(cell(r, f"{n}_s", 2) for n in names), _pct(s["reused_exact_share"]),
                     _pct(s["reused_approx_share"]), _pct(s["prefilled_share"]),
                     _pct(tf["first_token"]) if tf else "-", _pct(tf["prefix"]) if tf else "-",
                     f"{tf['turns']} ({tf['turns_approximated']} approx.)" if tf else "-",
                     _pct(r["free_running"]["same_text"]) if r["variant"] != "exact" else "-"])
    title = "Prompt tokens per agent, reused exactly / approximately / prefilled (first repeat):"
    parts = [format_table(columns, rows), "", title, "", agent_table(payload)]
    return "\n".join(parts)


def agent_table(payload: dict[str, Any]) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in payload["rows"]))
    by = {(r["dtype"], r["variant"]): r for r in payload["rows"]}
    rows = []
    for dtype in payload["dtypes"]:
        keys = list(by[(dtype, "exact")]["per_agent"]) if (dtype, "exact") in by else []
        for key in keys:
            cells = []
            for v in variants:
                a = by.get((dtype, v), {}).get("per_agent", {}).get(key)
                cells.append("-" if a is None else f"{_pct(a['reused_exact_share'])} / {_pct(a['reused_approx_share'])}"
                             f" / {_pct(a['prefilled_share'])}")
            turns = by[(dtype, "exact")]["per_agent"][key]
            rows.append([dtype, key, turns["turns"], round(turns["prompt_tokens"] / turns["turns"]), *cells])
    return format_table(["dtype", "workload/agent", "turns", "prompt tok/turn", *variants], rows)


def notes(payload: dict[str, Any]) -> list[str]:
    """Lines under the table in docs/results.md."""
    lines = [
        "documents: " + ", ".join(f"{k} {v} tokens" for k, v in payload["document_tokens"].items())
        + f"; {payload['max_tokens']} greedy tokens per turn; turns per repetition: "
        + ", ".join(f"{k} {v}" for k, v in payload["turns_per_workload"].items()),
    ]
    for r in payload["rows"]:
        tf = r.get("teacher_forced")
        if tf:
            enough = tf["turns"] >= payload.get("min_tf_turns", MIN_TF_TURNS)
            kl = r.get("kl")
            if kl:
                lines.append(f"{r['dtype']} {r['variant']}: KL(dense || approximate) after {kl['turns']} approximated "
                             f"turns: mean {kl['mean']:.4f}, median {kl['median']:.4f}, max {kl['max']:.4f} nats")
            lines.append(f"{r['dtype']} {r['variant']}: teacher-forced first-token agreement {_pct(tf['first_token'])} "
                         f"over {tf['turns']} reusing-agent turns ({tf['turns_approximated']} approximated) — "
                         + ("enough turns for a first-token claim" if enough else
                            f"**fewer than {payload.get('min_tf_turns', MIN_TF_TURNS)} turns: no first-token claim**"))
    if payload.get("skipped_variants"):
        lines.append("not run: " + ", ".join(payload["skipped_variants"]) + " (this engine's generate() has no reuse= "
                     "keyword)")
    lines.append("KL: " + payload.get("kl", {}).get("reason", KL_NOTE))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench agents", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES), choices=["float32", "bfloat16"],
                        help="engine dtypes, one client each (default: both)")
    parser.add_argument("--only", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS), metavar="WORKLOAD",
                        help=f"workloads to run (default all: {', '.join(WORKLOADS)})")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="variants to run (exact always runs: it is the fidelity reference)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed repetitions of every variant, alternating (default {DEFAULT_REPEATS}; "
                             "1 with --quick)")
    parser.add_argument("--tf-passes", type=int, default=None,
                        help=f"teacher-forced passes of each approximate variant, pass p on documents of seed p "
                             f"(default {DEFAULT_TF_PASSES}: 63 reusing-agent turns; 1 with --quick; 0: none)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="greedy tokens per turn, EOS ignored (default 32; 4 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: short documents, fewer turns, 1 repeat, 1 teacher-forced pass")
    record.add_arguments(parser, "agents")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else DEFAULT_REPEATS)
    tf_passes = args.tf_passes if args.tf_passes is not None else (1 if args.quick else DEFAULT_TF_PASSES)
    max_tokens = args.max_tokens if args.max_tokens is not None else (4 if args.quick else 32)
    if repeats < 1 or tf_passes < 0 or max_tokens < 1:
        parser.error("--repeats and --max-tokens must be >= 1, --tf-passes >= 0")
    variants = list(dict.fromkeys(["exact", *args.variants]))
    args.quick_record = args.quick_record or args.quick  # a smoke run is never published
    with record.Recording.from_args("agents", args, argv) as rec:
        payload = run(args.dtypes, args.only, repeats, tf_passes, max_tokens, args.quick, variants)
        print(table(payload))
        print()
        for line in notes(payload):
            print(f"- {line}")
        print(f"\nwritten: {rec.write(payload)}")
