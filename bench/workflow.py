"""A KVFlow-style agentic workflow under a tight device KV budget, cache designs side by side.

Ten agents with distinct fixed prompts run in a cycle with a branch:

    planner -> researcher -> {executor_a | executor_b | executor_c} -> coder -> expresser
            -> reviewer -> critic -> summarizer -> planner ...

One round is one trip around the cycle (8 calls). Each call is the agent's fixed prompt plus a
32-token dynamic suffix (built from the previous agent's output), and generates a few tokens. The
device KV budget holds about half of all fixed prompts. Variants, each on a fresh engine with the
same model and the same schedule, in one run:

(a) no prefix reuse; (b) radix cache + LRU, no slow tier; (c) LRU + slow tier with reactive
load-back (HiCache-like); (d) STE eviction + prefetch + status-aware scheduling (KVFlow-like).
Ablation (on by default, --no-bounded skips it): (d) with a bounded slow tier (a fraction of the
fixed-prompt blocks that do not fit on the device), with STE or LRU order inside the slow tier, to
show how much of (d)'s gain comes from STE ordering there.

Every variant reports all rounds and the steady state (rounds after the first: the first round
prefills every fixed prompt once, the same cold work for every variant), per-round time and
prefilled tokens, and per-agent TTFT mean and p90, and the KV pool's high-water mark (sampled).

With ``--repeats N`` the whole set of variants runs N times (variant order the same each time);
end-to-end seconds and TTFT mean (all rounds and steady state) are recorded for every repeat and
summarised as min/median/max; the per-round and per-call detail is the first repeat's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from kvbaton import SamplingParams, StepGraph
from kvbaton.bench import record
from kvbaton.bench.common import format_table
from kvbaton.bench.corpus import document
from kvbaton.bench.spread import cell, measured
from tqdm.auto import tqdm

AGENTS = ["planner", "researcher", "executor_a", "executor_b", "executor_c", "coder", "expresser",
          "reviewer", "critic", "summarizer"]
EXECUTORS = ["executor_a", "executor_b", "executor_c"]
ORDER_AFTER_EXECUTOR = ["coder", "expresser", "reviewer", "critic", "summarizer"]
# About 13-14 minutes for all six variants on a quiet 2-core CPU at the default sizes; 3 steady-state rounds.
DEFAULT_ROUNDS = 4


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    options: dict[str, Any]
    hints: bool


def step_graph() -> StepGraph:
    graph = StepGraph()
    graph.add_entry("planner")
    graph.add_edge("planner", "researcher")
    graph.add_router("researcher", EXECUTORS)
    for executor in EXECUTORS:
        graph.add_edge(executor, "coder")
    chain = ORDER_AFTER_EXECUTOR + ["planner"]
    for src, dst in pairwise(chain):
        graph.add_edge(src, dst)
    return graph


def schedule(rounds: int, seed: int) -> list[list[str]]:
    """The agents of each round; the router picks one executor per round."""
    rng = random.Random(seed)
    return [["planner", "researcher", rng.choice(EXECUTORS), *ORDER_AFTER_EXECUTOR] for _ in range(rounds)]


def p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile (with few samples, close to the maximum)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def summarize(calls: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """End-to-end time, prefill work and TTFT (overall and per agent) of a run of calls."""
    ttft = [c["ttft_s"] for c in calls]
    per_agent: dict[str, list[float]] = {}
    for c in calls:
        per_agent.setdefault(c["agent"], []).append(c["ttft_s"])
    return {
        "calls": len(calls),
        "end_to_end_s": seconds,
        "tokens_prefilled": sum(c["tokens_prefilled"] for c in calls),
        "tokens_reused": sum(c["tokens_reused"] for c in calls),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p90_s": p90(ttft),
        "per_agent_ttft": {a: {"calls": len(v), "mean_s": statistics.fmean(v), "p90_s": p90(v)}
                           for a, v in sorted(per_agent.items())},
    }


def run_variant(variant: Variant, engine_kwargs: dict[str, Any], fixed: dict[str, list[int]],
                rounds: list[list[str]], suffix_tokens: int, max_tokens: int) -> dict[str, Any]:
    from kvbaton.backend import Engine

    engine = Engine(**engine_kwargs, **variant.options)
    record.watch_kv(f"engine {variant.key}", record.pool_bytes(engine))
    sampled = record.PeakSampler({"pool": record.pool_bytes(engine)}).start()
    graph = step_graph()
    for name, tokens in fixed.items():
        engine.register_agent(name, tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    filler = engine.tokenize(document(200, seed=99))
    previous: list[int] = []
    calls: list[dict[str, Any]] = []
    round_seconds: list[float] = []
    progress = tqdm(total=sum(map(len, rounds)), desc=variant.key, unit="call", leave=False)
    step = 0
    for index, agents in enumerate(rounds):
        round_start = time.perf_counter()
        for agent in agents:
            call_start = time.perf_counter()
            if variant.hints:
                engine.hints(graph, running=[agent])
            dynamic = (previous + filler[step * 7 :])[:suffix_tokens]
            result = engine.complete(fixed[agent] + dynamic, params, agent=agent)
            previous = result.token_ids
            engine.release(result.handle)
            calls.append({"round": index + 1, "agent": agent, "seconds": time.perf_counter() - call_start,
                          "ttft_s": result.timings.ttft_s, "tokens_prefilled": result.timings.tokens_prefilled,
                          "tokens_reused": result.timings.tokens_reused})
            step += 1
            progress.update()
        round_seconds.append(time.perf_counter() - round_start)
    progress.close()
    stats = engine.stats()
    sampled.stop()
    engine.close()
    per_round = []
    for index, seconds in enumerate(round_seconds):
        mine = [c for c in calls if c["round"] == index + 1]
        summary = summarize(mine, seconds)
        per_round.append({"round": index + 1, "executor": rounds[index][2], "seconds": seconds,
                          "tokens_prefilled": summary["tokens_prefilled"], "tokens_reused": summary["tokens_reused"],
                          "ttft_mean_s": summary["ttft_mean_s"], "ttft_p90_s": summary["ttft_p90_s"]})
    steady = [c for c in calls if c["round"] > 1]
    return {
        "variant": variant.key,
        "label": variant.label,
        "options": dict(variant.options),
        **summarize(calls, sum(round_seconds)),
        "steady_state": summarize(steady, sum(round_seconds[1:])) if steady else None,
        "rounds": per_round,
        "call_log": calls,
        "cache": stats.cache.model_dump() if stats.cache else None,
        "peak_kv_bytes": sampled.total,
    }


def merge_repeats(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's row from its repeats: the first repeat's detail, with end-to-end seconds and TTFT
    mean (all rounds and steady state) as min/median/max over every repeat."""
    row = dict(repeats[0])
    for key in ("end_to_end_s", "ttft_mean_s", "ttft_p90_s"):
        measured(row, key, [r[key] for r in repeats])
    if row["steady_state"] is not None:
        steady = dict(row["steady_state"])
        for key in ("end_to_end_s", "ttft_mean_s", "ttft_p90_s"):
            measured(steady, key, [r["steady_state"][key] for r in repeats])
        row["steady_state"] = steady
    return row


def variants(tier_kind: str, big_tier: str, small_tier: str | None) -> list[Variant]:
    out = [
        Variant("a", "no prefix reuse", {"prefix_cache": False}, hints=False),
        Variant("b", "radix + LRU, no slow tier", {"eviction": "lru"}, hints=False),
        Variant("c", f"LRU + {tier_kind} tier, reactive load", {"eviction": "lru", "tiers": [big_tier],
                                                                 "prefetch": False}, hints=False),
        Variant("d", f"STE + {tier_kind} tier + prefetch", {"eviction": "ste", "tiers": [big_tier]}, hints=True),
    ]
    if small_tier is not None:
        # (d) twice with a slow tier too small for what the device cannot hold: the only difference
        # is the order in which the slow tier drops blocks.
        out += [
            Variant("d_bounded", f"STE + small {tier_kind} tier (STE order) + prefetch",
                    {"eviction": "ste", "tiers": [small_tier], "tier_eviction": "ste"}, hints=True),
            Variant("d_bounded_lru_tier", f"STE + small {tier_kind} tier (LRU order) + prefetch",
                    {"eviction": "ste", "tiers": [small_tier], "tier_eviction": "lru"}, hints=True),
        ]
    return out


def ratios(by_key: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Speed-ups of (d) over the baselines, and the bounded-tier ablation, for one set of summaries."""
    d = by_key["d"]
    out = {
        "b_over_d": by_key["b"]["end_to_end_s"] / d["end_to_end_s"],
        "c_over_d": by_key["c"]["end_to_end_s"] / d["end_to_end_s"],
        "a_over_d": by_key["a"]["end_to_end_s"] / d["end_to_end_s"],
        "c_p90_ttft_over_d": by_key["c"]["ttft_p90_s"] / d["ttft_p90_s"],
    }
    if "d_bounded" in by_key:
        ste, lru, b = by_key["d_bounded"], by_key["d_bounded_lru_tier"], by_key["b"]
        out["bounded_lru_tier_over_ste_tier"] = lru["end_to_end_s"] / ste["end_to_end_s"]
        # Of the time the bounded (d) saves against (b), the part that LRU order in the slow tier
        # would give back: the share of the gain due to STE ordering there.
        gain = b["end_to_end_s"] - ste["end_to_end_s"]
        if gain > 0:
            out["bounded_ste_tier_share_of_gain_over_b"] = (lru["end_to_end_s"] - ste["end_to_end_s"]) / gain
    return out


def run(rounds: int = DEFAULT_ROUNDS, fixed_min: int = 1024, fixed_max: int = 2048, suffix_tokens: int = 32,
        max_tokens: int = 16, budget_fraction: float = 0.5, device: str = "cpu", model: str | None = None,
        dtype: str = "float32", slow_tier: str = "auto", bounded: bool = True, bounded_tier_fraction: float = 0.5,
        seed: int = 0, repeats: int = 1) -> dict[str, Any]:
    from kvbaton.backend import Engine

    probe = Engine(model, dtype=dtype, device=device, kv_budget="16 blocks")
    # One short call first, so process-wide first-use costs (lazy init, kernel setup) fall on no variant.
    warmup = probe.complete(probe.tokenize(document(40, seed=98))[:48], SamplingParams(max_tokens=2, ignore_eos=True))
    probe.release(warmup.handle)
    rng = random.Random(seed)
    fixed = {}
    for i, name in enumerate(AGENTS):
        length = rng.randint(fixed_min, fixed_max)
        text = f"You are the {name} agent of an engineering team. Background notes:\n" + document(length, seed=100 + i)
        fixed[name] = probe.tokenize(text)[:length]
    bytes_per_block = probe.pool.shape.bytes_per_block
    block_size = probe.block_size
    model_name = probe.loaded.name
    probe.close()
    total_fixed_blocks = sum(len(t) // block_size for t in fixed.values())
    budget_blocks = int(total_fixed_blocks * budget_fraction)
    overflow_blocks = max(0, total_fixed_blocks - budget_blocks)
    tier_kind = ("host" if device.startswith("cuda") else "disk") if slow_tier == "auto" else slow_tier
    big_tier = f"{tier_kind}:{4 * total_fixed_blocks} blocks"
    small_tier = f"{tier_kind}:{max(1, int(overflow_blocks * bounded_tier_fraction))} blocks" if bounded else None
    engine_kwargs = {"model": model, "dtype": dtype, "device": device, "kv_budget": f"{budget_blocks} blocks"}
    plan = schedule(rounds, seed)
    chosen = variants(tier_kind, big_tier, small_tier)
    runs: dict[str, list[dict[str, Any]]] = {v.key: [] for v in chosen}
    for _ in range(repeats):
        for v in tqdm(chosen, desc="workflow variants", unit="variant"):
            runs[v.key].append(run_variant(v, engine_kwargs, fixed, plan, suffix_tokens, max_tokens))
    rows = [merge_repeats(runs[v.key]) for v in chosen]
    steady = {r["variant"]: r["steady_state"] for r in rows if r["steady_state"] is not None}
    return {
        "benchmark": "workflow",
        "model": model_name,
        "device": device,
        "dtype": dtype,
        "agents": len(AGENTS),
        "calls": sum(map(len, plan)),
        "rounds": rounds,
        "executors_by_round": [agents[2] for agents in plan],
        "fixed_prompt_tokens": {a: len(t) for a, t in fixed.items()},
        "suffix_tokens": suffix_tokens,
        "max_tokens": max_tokens,
        "device_budget_blocks": budget_blocks,
        "fixed_prompt_blocks": total_fixed_blocks,
        "bytes_per_block": bytes_per_block,
        "slow_tier": big_tier,
        "bounded_slow_tier": small_tier,
        "repeats": repeats,
        "rows": rows,
        "ratios": ratios({r["variant"]: r for r in rows}),
        "steady_state_ratios": ratios(steady) if len(steady) == len(rows) else None,
    }


def _mean_p90(summary: dict[str, Any] | None) -> str:
    return f"{cell(summary, 'ttft_mean_s')} / {cell(summary, 'ttft_p90_s')}" if summary else "-"


def _ratio_line(title: str, values: dict[str, float] | None) -> str:
    if values is None:
        return f"{title}: - (needs --rounds >= 2)"
    names = {"b_over_d": "(b)/(d)", "c_over_d": "(c)/(d)", "a_over_d": "(a)/(d)",
             "c_p90_ttft_over_d": "p90 TTFT (c)/(d)",
             "bounded_lru_tier_over_ste_tier": "bounded slow tier: LRU order / STE order",
             "bounded_ste_tier_share_of_gain_over_b": "share of bounded (d)'s gain over (b) due to STE tier order"}
    parts = [f"{names.get(k, k)} = {v:.0%}" if k.endswith("share_of_gain_over_b") else f"{names.get(k, k)} = {v:.2f}x"
             for k, v in values.items()]
    return f"{title}: " + ", ".join(parts)


def table(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    columns = ["variant", "all: e2e s", "all: prefilled tok", "all: TTFT mean / p90 s", "steady: e2e s",
               "steady: prefilled tok", "steady: TTFT mean / p90 s", "hits by tier (blocks)", "prefetch hit rate",
               "peak KV MiB"]
    main_rows = []
    for r in rows:
        cache = r["cache"] or {}
        steady = r["steady_state"]
        hits = ", ".join(f"{k}={v}" for k, v in sorted((cache.get("hits_blocks") or {}).items())) or "-"
        rate = f"{cache['prefetch_hit_rate']:.2f}" if cache.get("blocks_prefetched") else "-"
        main_rows.append([f"({r['variant']}) {r['label']}", cell(r, "end_to_end_s", 1), r["tokens_prefilled"],
                          _mean_p90(r), cell(steady, "end_to_end_s", 1) if steady else "-",
                          steady["tokens_prefilled"] if steady else "-", _mean_p90(steady), hits, rate,
                          f"{r['peak_kv_bytes'] / 2**20:.1f}" if r.get("peak_kv_bytes") is not None else "-"])
    executors = payload["executors_by_round"]
    round_columns = ["variant"] + [f"round {i + 1} ({e})" for i, e in enumerate(executors)]
    round_rows = [[f"({r['variant']})"] + [f"{x['seconds']:.1f} s, {x['tokens_prefilled']} tok" for x in r["rounds"]]
                  for r in rows]
    parts = [
        "All rounds and steady state (rounds after the first):",
        "",
        format_table(columns, main_rows),
        "",
        "Per round (end-to-end seconds, prefilled tokens; first repeat):",
        "",
        format_table(round_columns, round_rows),
    ]
    if all(r["steady_state"] for r in rows):
        agents = [a for a in AGENTS if any(a in r["steady_state"]["per_agent_ttft"] for r in rows)]
        agent_rows = [[a] + [_agent_cell(r["steady_state"]["per_agent_ttft"].get(a)) for r in rows] for a in agents]
        parts += ["", "Steady-state TTFT per agent, mean / p90 s (calls; first repeat):", "",
                  format_table(["agent"] + [f"({r['variant']})" for r in rows], agent_rows)]
    parts += ["", _ratio_line("ratios of medians, all rounds", payload["ratios"]), "",
              _ratio_line("ratios of medians, steady state", payload["steady_state_ratios"])]
    return "\n".join(parts)


def _agent_cell(entry: dict[str, Any] | None) -> str:
    return f"{entry['mean_s']:.3f} / {entry['p90_s']:.3f} ({entry['calls']})" if entry else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench workflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help=f"trips around the cycle, 8 calls each (default {DEFAULT_ROUNDS}: the first is cold, "
                             "the rest are the steady state)")
    parser.add_argument("--fixed-min", type=int, default=1024, help="shortest fixed prompt (tokens)")
    parser.add_argument("--fixed-max", type=int, default=2048, help="longest fixed prompt (tokens)")
    parser.add_argument("--suffix-tokens", type=int, default=32, help="dynamic suffix per call (tokens)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per call")
    parser.add_argument("--budget-fraction", type=float, default=0.5, help="device KV budget / sum of fixed prompts")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]; on cuda the slow tier is pinned host RAM")
    parser.add_argument("--model", default=None, help="default model or a local checkpoint dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--slow-tier", default="auto", choices=["auto", "host", "disk"],
                        help="auto: host RAM on cuda, disk on cpu")
    parser.add_argument("--bounded", action=argparse.BooleanOptionalAction, default=True,
                        help="run the bounded-slow-tier ablation, STE vs LRU order in the slow tier (default: on)")
    parser.add_argument("--bounded-tier-fraction", type=float, default=0.5,
                        help="bounded slow tier capacity / fixed-prompt blocks that do not fit the device budget "
                             "(default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="prompt lengths and the router's choices")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of the whole set of variants (default 1: ~14 minutes each at the default sizes)")
    record.add_arguments(parser, "workflow")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if not 0 < args.bounded_tier_fraction < 1:
        parser.error("--bounded-tier-fraction must be in (0, 1): the slow tier must be smaller than the overflow")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    name = "workflow" if args.device == "cpu" else f"workflow-{args.device.replace(':', '')}"
    with record.Recording.from_args("workflow", args, argv, name=name) as rec:
        payload = run(args.rounds, args.fixed_min, args.fixed_max, args.suffix_tokens, args.max_tokens,
                      args.budget_fraction, args.device, args.model, args.dtype, args.slow_tier, args.bounded,
                      args.bounded_tier_fraction, args.seed, args.repeats)
        print(table(payload))
        print(f"\nwritten: {rec.write(payload)}")
