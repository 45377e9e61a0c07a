"""Fidelity and reuse shares of the agents benchmark's runs (pure bookkeeping over turn records).

A run is ``{"workloads": {name: {"turns": [turn record, ...]}}}`` (:mod:`kvbaton.bench.agents`);
:func:`compare` sets its turns against a reference run's (first token, greedy prefix, whole text),
:func:`agreement` sums them up, :func:`shares` counts the prompt tokens reused exactly /
approximately / prefilled, :func:`kl_summary` the KL of approximated turns against dense prefill.
Only turns after each workload's first are compared: those are the turns that could reuse another
agent's cache.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvbaton.handle import common_prefix_length

MIN_TF_TURNS = 60
"""Teacher-forced turns a first-token agreement claim needs (the default 3 passes x 21 turns give 63)."""
KL_NOTE = ("KL(dense || approximate) of the next-token distribution after each approximated turn's prompt and "
           "answer, from `fidelity(handle, max_tokens=1)` (a dense prefill of the same tokens), on the first "
           "teacher-forced pass only (a dense reference per turn costs a full prefill); the time is not counted")


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
                        "prefix": common_prefix_length(mine["token_ids"], ref["token_ids"]) / max_tokens,
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


def rejections(run: dict[str, Any], reference: dict[str, Any]) -> list[dict[str, Any]]:
    """The turns whose approximation the confidence gate rejected (recomputed densely: ``discarded`` > 0), each
    with its time to first token over the reference (exact) run's for the same prompt: what a rejection cost
    against the dense prefill it fell back to (the exact run may have found more of that prompt cached)."""
    out = []
    for name, wl in run["workloads"].items():
        ref_turns = reference["workloads"][name]["turns"]
        for mine, ref in zip(wl["turns"], ref_turns, strict=True):
            if mine.get("discarded") and mine.get("ttft_s") and ref.get("ttft_s"):
                out.append({"workload": name, "index": mine["index"], "agent": mine["agent"],
                            "discarded": mine["discarded"], "prompt_tokens": mine["prompt_tokens"],
                            "ttft_over_exact": mine["ttft_s"] / ref["ttft_s"]})
    return out


def rejection_summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """How many teacher-forced turns the gate rejected, and what they cost over exact's."""
    ratios = sorted(t["ttft_over_exact"] for t in turns)
    return {"turns": len(turns), "tokens_discarded": sum(t["discarded"] for t in turns),
            "ttft_over_exact_median": statistics.median(ratios) if ratios else None,
            "ttft_over_exact_max": ratios[-1] if ratios else None, "detail": turns}
