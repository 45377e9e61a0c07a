"""``python -m kvbaton.bench family``: reuse and quality over the workload family (:mod:`kvbaton.bench.family`).

Per shape, in float32, on one embedded engine (started cold for every shape and variant: the prefix cache
flushed, the anchor pools cleared, no handle alive):

1. ``exact`` (``reuse="exact"``, dense prefill and exact prefix reuse only) runs the shape free: the reference;
2. ``auto`` and ``correct`` (and any ``--variants``) run it teacher-forced: every turn gets the reference run's
   prompt (its transcript), so each answer is compared with the reference's answer to the same prompt. An
   AutoGen team builds its own prompts: it runs free, and its turns are compared where their prompts are the
   same as the reference's (``comparable``).

Reported per shape and variant (:mod:`kvbaton.bench.family_table`): the share of shared-context tokens (the
turn's document, or its part) reused on the turns where another agent read that context before; the
decisions on every placed span and their reasons (``Result.segments``); seconds and speed against
``exact``; teacher-forced first-token agreement, greedy-prefix agreement and whole-continuation agreement with
``exact``; the KL of each approximate answer's next-token distribution against dense prefill
(``fidelity(handle, max_tokens=1)``, untimed); the question-answering set's accuracy (each shape's question
turns, answered right when the answer contains the planted fact) for ``exact`` and each variant; rejected
approximations (``tokens_discarded``) and their time to first token over ``exact``'s. Summaries per split
(``tune``, ``report``) against the targets of issue 46.

Every number comes from the public client API (``generate``, ``Result``, ``fidelity``), so the harness keeps
working when the engine's reuse step changes. ``--split tune|report|all`` chooses the shapes, ``--quick`` a
handful of them, small (tests), ``--only`` shapes by name or index. The record is written after every shape
(``partial`` until the last).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from kvbaton import SamplingParams
from kvbaton.bench import record
from kvbaton.bench.agents import cold, connect
from kvbaton.bench.family import Shape, family, first_readers, select
from kvbaton.bench.family_apps import RUNNERS
from kvbaton.bench.family_table import summarize, table
from kvbaton.bench.family_turns import RecordingClient, context_range, turn_record

VARIANTS = ("exact", "auto", "correct")
APPROXIMATE = ("auto", "rotate", "correct")
DEFAULT_MAX_TOKENS = 16  # a workflow turn: greedy, EOS ignored
DEFAULT_QA_TOKENS = 24  # a question's answer: greedy, stops at EOS
QUICK_MAX_TOKENS, QUICK_QA_TOKENS = 3, 8
QUICK_ARGS = ["--quick"]  # kvbaton bench all --quick


def sampling_of(shape: Shape, max_tokens: int, qa_tokens: int) -> Any:
    def of(index: int) -> SamplingParams:
        if index in shape.questions:
            return SamplingParams(max_tokens=qa_tokens)
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    return of


def run_shape(client: Any, shape: Shape, variant: str, max_tokens: int, qa_tokens: int,
              teacher: Sequence[str] | None = None, kl: bool = False) -> dict[str, Any]:
    """One run of ``shape`` with ``variant`` from a cold engine: its seconds (without the untimed KL checks)
    and its turn records."""
    cold(client)
    rec = RecordingClient(client.engine, sampling_of(shape, max_tokens, qa_tokens), kl=kl)
    start = time.perf_counter()
    RUNNERS[shape.app](shape, rec, variant, None if shape.app == "autogen" else teacher)
    seconds = time.perf_counter() - start - sum(c.kl_seconds for c in rec.calls.values())
    wl = shape.workload
    if sorted(rec.calls) != list(range(len(wl.turns))):
        raise RuntimeError(f"{shape.name}: ran turns {sorted(rec.calls)}, expected {len(wl.turns)}")
    readers = first_readers(shape)
    turns = []
    for i, call in sorted(rec.calls.items()):
        text = wl.document if shape.app == "autogen" else wl.context(i)
        entry = turn_record(call, context_range(rec, call.messages, call.prompt, text))
        entry.update({"kind": shape.kinds[i], "first_reader": readers[i], "question": i in shape.questions})
        if i in shape.questions:
            entry["answer"] = shape.questions[i].answer
            entry["correct"] = shape.questions[i].check(call.result.text)
        turns.append(entry)
    return {"variant": variant, "seconds": seconds, "turns": turns,
            "teacher_forced": teacher is not None and shape.app != "autogen"}


def run(names: Sequence[str] = (), split: str = "all", quick: bool = False, seed: int = 0,
        variants: Sequence[str] = VARIANTS, max_tokens: int = DEFAULT_MAX_TOKENS, qa_tokens: int = DEFAULT_QA_TOKENS,
        kl: bool = True, progress: Any = None, correction: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every chosen shape with every variant; ``progress(payload)`` after each shape (a partial record)."""
    if "exact" not in variants:
        raise ValueError("the exact variant is the reference: it always runs")
    shapes = select(family(seed, quick=quick), split, names, quick=quick)
    if not shapes:
        raise ValueError(f"no shape of split {split!r} matches {list(names)}")
    client = connect("float32", prefix_cache=True, quick=quick, correction=correction)
    record.watch_kv("engine float32", record.pool_bytes(client.engine))
    payload: dict[str, Any] = {
        "benchmark": "family", "dtypes": ["float32"], "seed": seed, "split": split, "quick": quick,
        "variants": list(variants), "max_tokens": max_tokens, "qa_tokens": qa_tokens, "kl": kl, "shapes": [],
        "correction": dataclasses.asdict(client.engine.correction),
    }
    try:
        for n, shape in enumerate(shapes, 1):
            started = time.perf_counter()
            runs = {"exact": run_shape(client, shape, "exact", max_tokens, qa_tokens)}
            teacher = [t["text"] for t in runs["exact"]["turns"]]
            for v in variants:
                if v != "exact":
                    runs[v] = run_shape(client, shape, v, max_tokens, qa_tokens, teacher, kl=kl and v in APPROXIMATE)
            cold(client)  # the audit's sampled checks run now, untimed
            payload["shapes"].append({
                "name": shape.name, "index": shape.index, **shape.tags(),
                "document_tokens": len(client.tokenize(shape.workload.document)),
                "persona_tokens": {a.name: len(client.tokenize(a.persona)) for a in shape.workload.agents.values()},
                "runs": runs,
            })
            payload.update(summarize(payload))
            print(f"family [{n}/{len(shapes)}] {shape.name}: {time.perf_counter() - started:.0f} s", flush=True)
            if progress is not None:
                progress(payload)
    finally:
        client.close()
    return payload


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench family", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", choices=["tune", "report", "all"], default="all",
                        help="which shapes: the tuning part, the reported part or all (default all)")
    parser.add_argument("--only", nargs="+", default=[], metavar="SHAPE", help="shapes by name or index")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=["exact", *APPROXIMATE],
                        help="reuse policies (exact always runs: it is the reference; default exact auto correct)")
    parser.add_argument("--seed", type=int, default=0, help="the family's seed (default 0)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"greedy tokens per workflow turn, EOS ignored (default {DEFAULT_MAX_TOKENS}; "
                             f"{QUICK_MAX_TOKENS} with --quick)")
    parser.add_argument("--qa-tokens", type=int, default=None,
                        help=f"greedy tokens of a question's answer, at most, stopping at EOS (default "
                             f"{DEFAULT_QA_TOKENS}; {QUICK_QA_TOKENS} with --quick)")
    parser.add_argument("--no-kl", action="store_true", help="skip the KL checks against dense prefill")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a handful of shapes, small")
    parser.add_argument("--correction", type=json.loads, default=None, metavar="JSON",
                        help='the engine\'s reuse settings (CorrectionConfig fields), e.g. \'{"deviation_threshold": '
                             '0.002}\': how a decision rule is tuned on the tune split (the record keeps them)')
    record.add_arguments(parser, "family")
    args = parser.parse_args(argv)
    max_tokens = args.max_tokens or (QUICK_MAX_TOKENS if args.quick else DEFAULT_MAX_TOKENS)
    qa_tokens = args.qa_tokens or (QUICK_QA_TOKENS if args.quick else DEFAULT_QA_TOKENS)
    args.quick_record = args.quick_record or args.quick  # a smoke run is never published
    variants = list(dict.fromkeys(["exact", *args.variants]))
    with record.Recording.from_args("family", args, argv) as rec:
        payload = run(args.only, args.split, args.quick, args.seed, variants, max_tokens, qa_tokens, not args.no_kl,
                      progress=lambda p: rec.write(p, partial=True), correction=args.correction)
        print(table(payload))
        print(f"\nwritten: {rec.write(payload)}")


__all__ = ["VARIANTS", "main", "run", "run_shape"]
