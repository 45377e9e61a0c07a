"""The family benchmark's bookkeeping: per shape and per split, from its turn records (pure, no model).

A shape's runs are ``{variant: {"seconds", "turns": [turn record, ...], "teacher_forced"}}``
(:mod:`kvbaton.bench.family_run`). :func:`shape_row` sets each variant against ``exact``: the turns compared
(every turn after the shape's first; for a run that was not teacher-forced, only turns whose prompt is the
reference's), first-token, greedy-prefix and whole-continuation agreement, the KL of approximate answers, the
share of shared-context tokens reused on the turns where another agent read that context before, the
decisions and their reasons, rejected approximations, question accuracy and speed. :func:`summarize` adds
the per-split summary with issue 46's targets; :func:`table` prints both.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvbaton.handle import common_prefix_length

SPLITS = ("tune", "report", "all")
# Issue 46's targets (held-out part of the family, fp32).
TARGET_CONTEXT_SHARE = 0.80  # of the shared-context tokens reused ...
TARGET_SHAPES_SHARE = 0.90  # ... in this share of the shapes where another agent read the context before
TARGET_FIRST_TOKEN = 0.95
TARGET_KL = 0.01
TARGET_POINTS = 0.02  # whole-continuation agreement and question accuracy: within 2 points of dense
TARGET_REJECTION_COST = 1.10  # a rejected span's time to first token over a dense prefill's
# What a span's reason says, as a category (the numbers stripped); checked in order, the first match names it.
REASONS = (
    ("too much to recompute selectively", "prefilled: deviation"),
    ("probe_min_margin", "rejected: probe margin"),
    ("after blending", "rejected: margin after blending"),
    ("give different next tokens", "rejected: blend and probe disagree"),
    ("low confidence", "rejected: low confidence"),
    ("context it attends to differ", "prefilled: context gap"),
    ("probe would compute", "prefilled: probe too costly"),
    ("found in the prefix cache", "exact: prefix cache"),
    ("same tokens before it", "exact: same context"),
    ("anchor", "recomputed: anchors"),
)


def reason_category(outcome: str, reason: str) -> str:
    """A placed span's decision as a category: its outcome where it was approximated, else what its reason says
    (an unknown reason: the reason with its numbers replaced by ``#``)."""
    if outcome in ("blended", "rotated", "corrected"):
        return outcome
    for needle, name in REASONS:
        if needle in reason:
            return name
    return f"{outcome}: {re.sub(r'[0-9][0-9.,%]*', '#', reason)[:60]}"


def _mean(values: Iterable[float]) -> float | None:
    found = list(values)
    return statistics.fmean(found) if found else None


def compare(run: Mapping[str, Any], reference: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Turn by turn against the reference run: every turn after the first whose prompt the reference's is."""
    out = []
    for mine, ref in zip(run["turns"], reference["turns"], strict=True):
        if mine["index"] == 0 or (not run.get("teacher_forced") and mine["prompt_sha"] != ref["prompt_sha"]):
            continue
        n = max(len(ref["token_ids"]), 1)
        out.append({"index": mine["index"], "first_token": mine["token_ids"][:1] == ref["token_ids"][:1],
                    "prefix": common_prefix_length(mine["token_ids"], ref["token_ids"]) / n,
                    "same_text": mine["token_ids"] == ref["token_ids"], "approximated": mine["reused_approx"] > 0,
                    "kl": mine.get("kl")})
    return out


def context_share(turns: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Shared-context tokens reused on the turns where another agent read that context before."""
    firsts = [t for t in turns if t["first_reader"] and t["context_tokens"]]
    tokens = sum(t["context_tokens"] for t in firsts)
    reused = sum(t["context_reused"] for t in firsts)
    return {"turns": len(firsts), "tokens": tokens, "reused": reused, "share": reused / tokens if tokens else None}


def decisions(turns: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    spans = [s for t in turns for s in t["segments"]]
    return {"spans": len(spans), "outcomes": dict(Counter(s["outcome"] for s in spans)),
            "reasons": dict(Counter(reason_category(s["outcome"], s["reason"]) for s in spans)),
            "examples": sorted({s["reason"] for s in spans if s["outcome"] == "recomputed"})[:4]}


def rejections(run: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, Any]:
    """Turns whose approximation was rejected (``discarded`` > 0) and their time to first token over the
    reference's for the same turn (teacher-forced: the same prompt)."""
    ratios = [mine["ttft_s"] / ref["ttft_s"] for mine, ref in zip(run["turns"], reference["turns"], strict=True)
              if mine["discarded"] and ref["ttft_s"] and run.get("teacher_forced")]
    return {"turns": sum(1 for t in run["turns"] if t["discarded"]),
            "tokens_discarded": sum(t["discarded"] for t in run["turns"]),
            "ttft_over_exact_max": max(ratios) if ratios else None}


def questions(turns: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    asked = [t for t in turns if t["question"]]
    return {"asked": len(asked), "correct": sum(t["correct"] for t in asked)}


def shape_row(shape: Mapping[str, Any]) -> dict[str, Any]:
    """One shape's row: every variant against ``exact``."""
    runs = shape["runs"]
    ref = runs["exact"]
    row: dict[str, Any] = {k: shape[k] for k in ("name", "index", "split", "topology", "doc_kind", "app", "release",
                                                  "document_tokens", "turns")}
    row["questions"] = questions(ref["turns"])
    row["variants"] = {}
    for v, run in runs.items():
        compared = compare(run, ref) if v != "exact" else []
        kls = [c["kl"] for c in compared if c["kl"] is not None]
        row["variants"][v] = {
            "seconds": run["seconds"], "speedup_vs_exact": ref["seconds"] / run["seconds"] if run["seconds"] else None,
            "context": context_share(run["turns"]), "decisions": decisions(run["turns"]),
            "prompt_tokens": sum(t["prompt_tokens"] for t in run["turns"]),
            "reused_exact": sum(t["reused_exact"] for t in run["turns"]),
            "reused_approx": sum(t["reused_approx"] for t in run["turns"]),
            "results_not_exact": sum(not t["exact"] for t in run["turns"]),
            "compared": len(compared), "approximated": sum(c["approximated"] for c in compared),
            "first_token": _mean(c["first_token"] for c in compared),
            "prefix": _mean(c["prefix"] for c in compared),
            "same_text": _mean(c["same_text"] for c in compared),
            "kl_turns": len(kls), "kl_mean": _mean(kls), "kl_max": max(kls) if kls else None,
            "questions": questions(run["turns"]), "rejections": rejections(run, ref) if v != "exact" else None,
        }
    return row


def _weighted(rows: Sequence[Mapping[str, Any]], key: str, weight: str) -> float | None:
    """The mean of ``key`` over ``rows``, each weighted by its ``weight`` (None: no weight)."""
    total = sum(r[weight] for r in rows)
    return sum(r[key] * r[weight] for r in rows if r[weight]) / total if total else None


def split_summary(rows: Sequence[Mapping[str, Any]], variant: str) -> dict[str, Any]:
    """One variant over ``rows``, with issue 46's targets."""
    vs = [r["variants"][variant] for r in rows if variant in r["variants"]]
    exact = [r["variants"]["exact"] for r in rows if variant in r["variants"]]
    reading = [v["context"] for v in vs if v["context"]["tokens"]]
    shares = [c["share"] for c in reading]
    compared = sum(v["compared"] for v in vs)
    kl_turns = sum(v["kl_turns"] for v in vs)
    asked = sum(v["questions"]["asked"] for v in vs)
    ratios = [v["rejections"]["ttft_over_exact_max"] for v in vs
              if v["rejections"] and v["rejections"]["ttft_over_exact_max"] is not None]
    out: dict[str, Any] = {
        "shapes": len(vs), "shapes_read_before": len(reading),
        "shapes_reusing_80": sum(s >= TARGET_CONTEXT_SHARE for s in shares),
        "context_share": (sum(c["reused"] for c in reading) / sum(c["tokens"] for c in reading)) if reading else None,
        "context_share_median": statistics.median(shares) if shares else None,
        "compared": compared,
        "first_token": _weighted(vs, "first_token", "compared"),
        "same_text": _weighted(vs, "same_text", "compared"),
        "kl_turns": kl_turns,
        "kl_mean": _weighted(vs, "kl_mean", "kl_turns"),
        "kl_max": max((v["kl_max"] for v in vs if v["kl_max"] is not None), default=None),
        "questions": asked,
        "accuracy": sum(v["questions"]["correct"] for v in vs) / asked if asked else None,
        "accuracy_exact": sum(e["questions"]["correct"] for e in exact) / asked if asked else None,
        "rejected_turns": sum(v["rejections"]["turns"] for v in vs if v["rejections"]),
        "rejection_cost_max": max(ratios) if ratios else None,
        "seconds": sum(v["seconds"] for v in vs), "seconds_exact": sum(e["seconds"] for e in exact),
        "speedup_median": statistics.median([v["speedup_vs_exact"] for v in vs if v["speedup_vs_exact"]])
        if vs else None,
        "decisions": dict(sum((Counter(v["decisions"]["reasons"]) for v in vs), Counter())),
    }
    out["speedup"] = out["seconds_exact"] / out["seconds"] if out["seconds"] else None
    if variant != "exact":
        out["targets"] = targets(out)
    return out


def targets(s: Mapping[str, Any]) -> dict[str, bool | None]:
    """Issue 46's targets, met or not (None: nothing measured)."""
    def at_least(value: float | None, bound: float) -> bool | None:
        return None if value is None else value >= bound

    return {
        "context_reuse_80_in_90pct_of_shapes": at_least(s["shapes_reusing_80"] / s["shapes_read_before"]
                                                        if s["shapes_read_before"] else None, TARGET_SHAPES_SHARE),
        "first_token_95": at_least(s["first_token"], TARGET_FIRST_TOKEN),
        "kl_mean_0.01": None if s["kl_mean"] is None else s["kl_mean"] <= TARGET_KL,
        "continuation_within_2_points": at_least(s["same_text"], 1 - TARGET_POINTS),
        "accuracy_within_2_points": None if s["accuracy"] is None or s["accuracy_exact"] is None
        else s["accuracy"] >= s["accuracy_exact"] - TARGET_POINTS,
        "rejection_cost_1.1": None if s["rejection_cost_max"] is None
        else s["rejection_cost_max"] <= TARGET_REJECTION_COST,
    }


def summarize(payload: Mapping[str, Any]) -> dict[str, Any]:
    """``rows`` (one per shape) and ``summary`` (per split, per variant) of a family payload."""
    rows = [shape_row(s) for s in payload["shapes"]]
    summary = {split: {v: split_summary([r for r in rows if split in ("all", r["split"])], v)
                       for v in payload["variants"]}
               for split in SPLITS if any(split in ("all", r["split"]) for r in rows)}
    return {"rows": rows, "summary": summary}


def _f(value: float | None, fmt: str = "{:.0%}") -> str:
    return "-" if value is None else fmt.format(value)


def _reasons(reasons: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1]))


def table(payload: Mapping[str, Any]) -> str:
    """Per shape, then per split: the reused share, speed, agreement, KL, questions, and the decisions."""
    rows = payload.get("rows") or summarize(payload)["rows"]
    variants = [v for v in payload["variants"] if v != "exact"]
    lines = []
    for v in variants:
        lines.append(f"== {v} vs exact (fp32; context: shared-context tokens reused where another agent read it "
                     f"before; agreement teacher-forced)")
        lines.append(f"{'shape':40} {'split':6} {'ctx tok':>7} {'reused':>6} {'speed':>6} {'1st tok':>8} "
                     f"{'same':>5} {'KL mean':>8} {'QA ex/'+v[:4]:>9}  decisions")
        for r in rows:
            x = r["variants"].get(v)
            if x is None:
                continue
            ctx, q, qe = x["context"], x["questions"], r["variants"]["exact"]["questions"]
            lines.append(
                f"{r['name']:40} {r['split']:6} {ctx['tokens']:>7} {_f(ctx['share']):>6} "
                f"{_f(x['speedup_vs_exact'], '{:.2f}x'):>6} {_f(x['first_token']):>5}/{x['compared']:<2} "
                f"{_f(x['same_text']):>5} {_f(x['kl_mean'], '{:.4f}'):>8} {qe['correct']:>4}/{q['correct']:<4}  "
                f"{_reasons(x['decisions']['reasons'])}")
        for split, by in payload.get("summary", {}).items():
            s = by.get(v)
            if not s:
                continue
            lines.append(
                f"  {split}: {s['shapes']} shapes; context reused {_f(s['context_share'])} (>= 80% in "
                f"{s['shapes_reusing_80']}/{s['shapes_read_before']}); first token {_f(s['first_token'], '{:.1%}')} of "
                f"{s['compared']}; same continuation {_f(s['same_text'], '{:.1%}')}; KL mean "
                f"{_f(s['kl_mean'], '{:.4f}')} ({s['kl_turns']} approximated); questions {_f(s['accuracy_exact'])} "
                f"exact / {_f(s['accuracy'])} {v} of {s['questions']}; speed {_f(s['speedup'], '{:.2f}x')} "
                f"(median {_f(s['speedup_median'], '{:.2f}x')}); rejected {s['rejected_turns']} (worst ttft "
                f"{_f(s['rejection_cost_max'], '{:.2f}x')} exact's)")
            lines.append(f"    targets: {', '.join(f'{name} {met}' for name, met in s['targets'].items())}")
        lines.append("")
    return "\n".join(lines)


__all__ = ["compare", "context_share", "decisions", "reason_category", "shape_row", "split_summary", "summarize",
           "table", "targets"]
