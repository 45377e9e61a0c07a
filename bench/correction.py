"""Shared segments behind different prefixes: dense vs rotation vs anchor-pool correction, side by side.

Each trajectory is a 4-agent workflow over one shared document (varied content per trajectory):
agent A (planner) reads it densely and writes a short note; B reads the document behind its own
system prompt, C reads B's copy of it (a chain), and D fans in C's copy of the document plus A's note.
B, C and D are the reusing agents. For every method the same trajectory runs in the same engine:

- ``dense``: every segment prefilled behind the agent's own prefix (no sharing; the fidelity reference);
- ``rotate``: cached keys re-aligned to the new positions, no correction;
- ``full``: KVCOMM-like full-dimensional anchors, context-free reference (non-chained);
- ``lowrank``: low-rank anchors, context-free reference (non-chained);
- ``lowrank_chained``: low-rank anchors, the source agent's cache as reference (KVCMAS);
- ``lowrank_chained_nogate``: the same without the confidence gate (``min_margin=0``); its per-prompt
  next-token margins and agreements also show what each gate threshold would recompute and catch.

Before the measured trajectories of each length, ``--warmup`` trajectories run only the anchor
methods, so their pools hold anchors as they would in a long-running workflow (the first
``min_anchors`` segments of every slot and source are always prefilled densely). Reported per method and
shared-context length: TTFT of the reusing agents (the composition, including
any reference prefill, correction and dense fallback, up to the first token's logits), first-token
agreement, greedy agreement over 32 tokens and mean KL against the dense method's handle of the same
tokens, the reuse ratio (segment tokens not prefilled), the outcomes, and the anchor-pool memory.
The prefix cache is flushed before each method's turn, so no method finds another's work.

Every reusing-agent prompt is one trial: the record keeps each prompt's TTFT, first-token
agreement, greedy agreement, KL and margin, the rows give TTFT min/median/max beside the mean, and
``configs`` holds every method's effective ``CorrectionConfig`` (``default_gate`` says whether the
gated method ran at the default gate). The speed-up over dense (``speedup_vs_dense``) is a ratio of
MEAN TTFTs: a gated method's TTFTs are bimodal (a corrected prompt is fast, a recomputed one pays a
dense prefill too), and only the mean counts every recompute's cost; tables and headlines say so.
``margin_analysis`` is a simulation from the ungated method's margins, not a measurement: docs never
publish it as a result.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbaton import SamplingParams
from kvbaton.bench import record, spread
from kvbaton.bench.common import format_table
from kvbaton.bench.corpus import document
from kvbaton.bench.spread import cell
from tqdm.auto import tqdm

METHODS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "dense": ("dense", None),
    "rotate": ("rotate", None),
    "full": ("auto", {"method": "full", "chained": False}),
    "lowrank": ("auto", {"method": "lowrank", "chained": False}),
    "lowrank_chained": ("auto", {"method": "lowrank", "chained": True}),
    # The same without the confidence gate: what the margin gate buys, and data to choose its threshold.
    "lowrank_chained_nogate": ("auto", {"method": "lowrank", "chained": True, "min_margin": 0.0}),
}
MARGINS = (0.25, 0.5, 0.6, 0.75, 1.0, 1.5, 2.0)
SYSTEMS = {
    "A": "You are the planner. Read the meeting notes and write a short numbered plan for the week.",
    "B": "You are the reviewer. You check plans for risks, missing owners and unrealistic dates.",
    "C": "You are the scheduler. You turn notes into a timeline and flag conflicts between teams.",
    "D": "You are the reporter. You merge everyone's findings into a brief status update for leadership.",
}
ASKS = {
    "A": "Write the plan in three short points.",
    "B": "What is the biggest risk in these notes?",
    "C": "Which team is on the critical path?",
    "D": "Combine the notes and the plan into a two-sentence update.",
}


def _turn(engine: Any, text: str) -> list[int]:
    return engine.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def run(
    lengths: tuple[int, ...] = (1024, 2048, 4096),
    trajectories: int = 20,
    greedy_tokens: int = 32,
    note_tokens: int = 16,
    gate: dict[str, Any] | None = None,
    warmup: int = 4,
    on_length: Callable[[dict[str, Any]], None] | None = None,
    only: tuple[str, ...] = (),
) -> dict[str, Any]:
    from kvbaton.backend import Engine
    from kvbaton.backend.reuse.correction import CorrectionConfig

    engine = Engine(kv_budget="8GiB")
    record.watch_kv("engine", record.pool_bytes(engine))
    system = {
        a: engine.chat_tokens([{"role": "system", "content": s}], add_generation_prompt=False) for a, s in SYSTEMS.items()
    }
    asks = {a: _turn(engine, q) for a, q in ASKS.items()}
    unknown = set(only) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown method(s) {sorted(unknown)}; choose from {list(METHODS)}")
    # The method's own settings win over the command line's gate (the no-gate ablation stays ungated).
    methods = {
        name: (mode, None if cfg is None else {**(gate or {}), **cfg})
        for name, (mode, cfg) in METHODS.items() if not only or name in only or name == "dense"
    }
    configs = {name: None if cfg is None else dataclasses.asdict(CorrectionConfig(**cfg))
               for name, (_, cfg) in methods.items()}
    default = dataclasses.asdict(CorrectionConfig())
    rows: list[dict[str, Any]] = []
    samples: dict[str, Any] = {}
    for length in lengths:
        per: dict[str, dict[str, list[Any]]] = {m: {"ttft": [], "first": [], "greedy": [], "kl": [], "reuse": [],
                                                    "outcomes": [], "margin": []} for m in methods}
        for t in tqdm(range(-warmup, trajectories), desc=f"correction {length} tokens", unit="trajectory"):
            measured = t >= 0
            doc = engine.tokenize("<|im_start|>user\n" + document(int(length * 0.9) + 50, seed=1000 * length + t))[:length]
            if len(doc) < length:
                raise RuntimeError("corpus too short for the requested length")
            # A is always prefilled densely: the exact first-agent cache chained correction starts from.
            note = engine.resume(
                engine.materialize(system["A"] + doc + asks["A"], agent="A"),
                "", SamplingParams(max_tokens=note_tokens, ignore_eos=True), agent="A",
            )
            a = note.handle
            doc_a = a.segment(len(system["A"]), len(system["A"]) + length, slot="document")
            note_start = len(system["A"]) + length + len(asks["A"])
            note_a = a.segment(note_start, a.num_tokens, slot="note")
            handles: dict[str, dict[str, Any]] = {}
            for name, (mode, cfg) in methods.items():
                if not measured and cfg is None:
                    continue  # warm-up trajectories only fill the anchor pools
                engine.flush_cache()
                b = engine.compose(system["B"], [doc_a], asks["B"], agent="B", mode=mode, correction=cfg)
                doc_b = b.handle.segment(len(system["B"]), len(system["B"]) + length, slot="document")
                c = engine.compose(system["C"], [doc_b], asks["C"], agent="C", mode=mode, correction=cfg)
                doc_c = c.handle.segment(len(system["C"]), len(system["C"]) + length, slot="document")
                d = engine.compose(system["D"], [doc_c, note_a], asks["D"], agent="D", mode=mode, correction=cfg)
                handles[name] = {"B": b, "C": c, "D": d}
                for comp in (b, c, d) if measured else ():
                    seg_tokens = sum(s.end - s.start for s in comp.segments)
                    per[name]["ttft"].append(comp.compose_s)
                    per[name]["reuse"].append(sum(s.tokens_reused for s in comp.segments) / seg_tokens)
                    per[name]["outcomes"].extend(s.outcome for s in comp.segments)
                    per[name]["margin"].append(comp.margin)
            # Fidelity against the dense handles of the same tokens, all candidates decoding in one batch.
            jobs = [(name, agent) for name in methods if name != "dense" for agent in "BCD"] if measured else []
            with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
                results = list(pool.map(
                    lambda job: engine.fidelity(
                        handles[job[0]][job[1]].handle, greedy_tokens, reference=handles["dense"][job[1]].handle
                    ),
                    jobs,
                ))
            for _, cfg in methods.values():
                if cfg is not None:
                    engine.anchor_pool(cfg).flush()  # anchors from this trajectory are ready for the next
            for (name, agent), fid in zip(jobs, results, strict=True):
                per[name]["first"].append(fid.first_token_agrees)
                per[name]["greedy"].append(fid.greedy_agreement)
                per[name]["kl"].append(fid.kl_mean)
                if t == 0:
                    samples.setdefault(str(length), {})[f"{name}/{agent}"] = {
                        "dense": engine.detokenize(fid.dense_token_ids), "method": engine.detokenize(fid.handle_token_ids)
                    }
            for agent in "BCD" if measured else ():
                per["dense"]["first"].append(True)
                per["dense"]["greedy"].append(1.0)
                per["dense"]["kl"].append(0.0)
            engine.release([a] + [h[x].handle for h in handles.values() for x in "BCD"])
        dense_ttft = statistics.mean(per["dense"]["ttft"])
        for name, (_, cfg) in methods.items():
            m = per[name]
            ttft = statistics.mean(m["ttft"])
            pool_bytes = engine.anchor_pool(cfg).nbytes if cfg is not None else 0
            row = spread.measured({  # (`measured` below is the warm-up flag)
                "shared_tokens": length,
                "method": name,
                "trajectories": trajectories,
                "warmup_trajectories": warmup,
                "prompts": len(m["first"]),
                "ttft_mean_s": ttft,
                "ttft_p90_s": sorted(m["ttft"])[int(0.9 * (len(m["ttft"]) - 1))],
                "speedup_vs_dense": dense_ttft / ttft,
                "first_token_agreement": sum(m["first"]) / len(m["first"]),
                "greedy32_agreement": statistics.mean(m["greedy"]),
                "kl_mean": statistics.mean(m["kl"]),
                "reuse_ratio": statistics.mean(m["reuse"]),
                "outcomes": dict(Counter(m["outcomes"])),
                "anchor_pool_bytes": pool_bytes,
                "anchors": engine.anchor_pool(cfg).num_anchors if cfg is not None else 0,
                "margins": m["margin"],
                "first_token_agrees": m["first"],
                "ttfts": m["ttft"],
                "kls": m["kl"],
                "greedy_agreements": m["greedy"],
            }, "ttft_s", m["ttft"])
            rows.append(row)
        for name, (_, cfg) in methods.items():
            if cfg is not None:
                engine.anchor_pool(cfg).clear()  # each length starts with empty pools
        result = {"benchmark": "correction", "lengths": list(lengths), "trajectories": trajectories,
                  "warmup": warmup, "greedy_tokens": greedy_tokens, "gate": gate or {}, "configs": configs,
                  "default_config": default,
                  "default_gate": configs.get("lowrank_chained") == default if "lowrank_chained" in configs else None,
                  "rows": rows, "margin_analysis": margin_analysis(rows), "samples": samples}
        if on_length is not None:  # after every length, so a long run keeps what it measured
            on_length(result)
    engine.close()
    return result


def margin_analysis(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For the ungated method: what a confidence gate at each threshold would recompute and agree on.

    A prompt whose approximated composition has a next-token margin below the threshold would be
    recomputed densely (agreeing by construction); the others keep their measured agreement.
    """
    out = []
    dense = {r["shared_tokens"]: r for r in rows if r["method"] == "dense"}
    for row in rows:
        if row["method"] != "lowrank_chained_nogate":
            continue
        # A recomputed prompt costs its approximation plus a dense prefill (an upper bound: the exact
        # prefix before the first approximated position is kept).
        dense_ttfts = dense[row["shared_tokens"]].get("ttfts", [])
        pairs = [(m, a) for m, a in zip(row["margins"], row["first_token_agrees"], strict=True) if m is not None]
        for threshold in MARGINS:
            below = [a for m, a in pairs if m < threshold]
            above = [a for m, a in pairs if m >= threshold]
            total = len(row["first_token_agrees"])
            ttft = None
            if dense_ttfts and len(dense_ttfts) == len(row.get("ttfts", [])):
                costs = [t + (d if m is not None and m < threshold else 0.0)
                         for t, d, m in zip(row["ttfts"], dense_ttfts, row["margins"], strict=True)]
                ttft = statistics.mean(costs)
            out.append({"shared_tokens": row["shared_tokens"], "min_margin": threshold,
                        "ttft_mean_s": ttft,
                        "speedup_vs_dense": dense[row["shared_tokens"]]["ttft_mean_s"] / ttft if ttft else None,
                        "recomputed_share": len(below) / total if total else 0.0,
                        "first_token_agreement": (total - len(pairs) + len(below) + sum(above)) / total if total else 1.0,
                        "disagreements_below": sum(not a for a in below)})
    return out


# What the report prints above the table, instead of the other benchmarks' "median of the repeats".
SUMMARY = ("Each reusing-agent prompt is one trial. TTFT: the mean over the prompts, their median [min–max] and p90 "
           "beside it; \"vs dense\" is the ratio of mean TTFTs (dense's over the method's), which counts the full cost "
           "of every prompt the gate recomputed. Agreement: the share of prompts; KL and greedy agreement: means.")


def table(result: dict[str, Any], simulated: bool = True) -> str:
    """The measured rows; with ``simulated``, also the gate-threshold simulation (labelled as such)."""
    columns = ["shared", "method", "prompts", "TTFT mean s", "TTFT median [min–max] s", "p90 s", "vs dense (means)",
               "1st tok", "greedy32", "KL", "reuse", "anchor MiB", "outcomes"]
    rows = [
        [r["shared_tokens"], r["method"], r.get("prompts", len(r.get("first_token_agrees", []))), r["ttft_mean_s"],
         cell(r, "ttft_s") if "ttft_s" in r else "-", r["ttft_p90_s"], f"{r['speedup_vs_dense']:.2f}x",
         f"{100 * r['first_token_agreement']:.0f}%", f"{100 * r['greedy32_agreement']:.0f}%", r["kl_mean"],
         f"{100 * r['reuse_ratio']:.0f}%", r["anchor_pool_bytes"] / 2**20,
         " ".join(f"{k}:{v}" for k, v in sorted(r["outcomes"].items()))]
        for r in result["rows"]
    ]
    text = format_table(columns, rows)
    if simulated and result.get("margin_analysis"):
        text += "\n\nconfidence gate thresholds, SIMULATED on lowrank_chained_nogate (not measured):\n" + format_table(
            ["shared", "min_margin", "recomputed", "1st tok", "flips caught", "TTFT s (est.)", "vs dense (est.)"],
            [[a["shared_tokens"], a["min_margin"], f"{100 * a['recomputed_share']:.0f}%",
              f"{100 * a['first_token_agreement']:.0f}%", a["disagreements_below"], a.get("ttft_mean_s") or "-",
              f"{a['speedup_vs_dense']:.2f}x" if a.get("speedup_vs_dense") else "-"]
             for a in result["margin_analysis"]])
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvbaton.bench correction",
        description="Shared segments behind different prefixes: dense / rotation / full-dim anchors / "
        "low-rank non-chained / low-rank chained; TTFT and fidelity side by side.",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="shared-context tokens")
    parser.add_argument("--trajectories", type=int, default=20, help="measured trajectories (documents) per length")
    parser.add_argument("--warmup", type=int, default=4,
                        help="trajectories per length that only fill the anchor pools (not measured)")
    parser.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens compared against dense")
    parser.add_argument("--entropy-threshold", type=float, help="gate: max normalized entropy of anchor weights")
    parser.add_argument("--temperature", type=float, help="softmax temperature of the anchor weights")
    parser.add_argument("--max-distance", type=float, help="gate: max relative distance of the nearest anchor")
    parser.add_argument("--min-anchors", type=int, help="gate: anchors needed before correcting")
    parser.add_argument("--rank", type=int, help="rank of the low-rank anchors")
    parser.add_argument("--pool-size", type=int, help="anchors kept per slot and source")
    parser.add_argument("--min-margin", type=float,
                        help="confidence gate: next-token top-2 logit margin below which compose recomputes densely")
    parser.add_argument("--methods", nargs="+", default=(), choices=list(METHODS),
                        help="methods to run (dense always runs: it is the reference); default all")
    record.add_arguments(parser, "correction")
    args = parser.parse_args(argv)
    gate = {k: v for k, v in {
        "entropy_threshold": args.entropy_threshold, "temperature": args.temperature,
        "max_distance": args.max_distance, "min_anchors": args.min_anchors, "rank": args.rank,
        "pool_size": args.pool_size, "min_margin": args.min_margin,
    }.items() if v is not None}
    with record.Recording.from_args("correction", args, argv) as rec:
        def partial(result: dict[str, Any]) -> None:
            rec.write(result, partial=True)
            print(table(result), flush=True)

        result = run(tuple(args.lengths), args.trajectories, args.greedy_tokens, gate=gate, warmup=args.warmup,
                     on_length=partial, only=tuple(args.methods))
        print(f"written: {rec.write(result)}")


if __name__ == "__main__":
    main()
