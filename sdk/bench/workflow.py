"""A KVFlow-style agentic workflow under a tight device KV budget, four cache designs side by side.

Ten agents with distinct fixed prompts run in a cycle with a branch:

    planner -> researcher -> {executor_a | executor_b | executor_c} -> coder -> expresser
            -> reviewer -> critic -> summarizer -> planner ...

Each call is the agent's fixed prompt plus a 32-token dynamic suffix (built from the previous
agent's output), and generates a few tokens. The device KV budget holds about half of all fixed
prompts. Variants, each on a fresh engine with the same model, in one run:

(a) no prefix reuse; (b) radix cache + LRU, no slow tier; (c) LRU + slow tier with reactive
load-back (HiCache-like); (d) STE eviction + prefetch + status-aware scheduling (KVFlow-like).
With ``--bounded`` two more variants bound the slow tier below the working set, with STE or LRU
order inside the slow tier, to show how much of (d)'s gain comes from STE ordering there.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from kvbaton import SamplingParams, StepGraph
from kvbaton.bench.common import format_table, machine_info, write_results
from kvbaton.bench.corpus import document

AGENTS = ["planner", "researcher", "executor_a", "executor_b", "executor_c", "coder", "expresser",
          "reviewer", "critic", "summarizer"]
EXECUTORS = ["executor_a", "executor_b", "executor_c"]
ORDER_AFTER_EXECUTOR = ["coder", "expresser", "reviewer", "critic", "summarizer"]


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
    for src, dst in zip(chain, chain[1:]):
        graph.add_edge(src, dst)
    return graph


def schedule(rounds: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    order: list[str] = []
    for _ in range(rounds):
        order += ["planner", "researcher", rng.choice(EXECUTORS), *ORDER_AFTER_EXECUTOR]
    return order


def run_variant(variant: Variant, engine_kwargs: dict[str, Any], fixed: dict[str, list[int]],
                order: list[str], suffix_tokens: int, max_tokens: int) -> dict[str, Any]:
    from kvbaton.backend import Engine

    engine = Engine(**engine_kwargs, **variant.options)
    graph = step_graph()
    for name, tokens in fixed.items():
        engine.register_agent(name, tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    filler = engine.tokenize(document(200, seed=99))
    previous: list[int] = []
    ttft: dict[str, list[float]] = {}
    start = time.perf_counter()
    for step, agent in enumerate(tqdm(order, desc=variant.key, unit="call", leave=False)):
        if variant.hints:
            engine.hints(graph, running=[agent])
        dynamic = (previous + filler[step * 7 :])[:suffix_tokens]
        result = engine.complete(fixed[agent] + dynamic, params, agent=agent)
        ttft.setdefault(agent, []).append(result.timings.ttft_s)
        previous = result.token_ids
        engine.release(result.handle)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    engine.close()
    all_ttft = [t for values in ttft.values() for t in values]
    cache = stats.cache.model_dump() if stats.cache else None
    return {
        "variant": variant.key,
        "label": variant.label,
        "options": {k: v for k, v in variant.options.items()},
        "end_to_end_s": elapsed,
        "tokens_prefilled": stats.tokens_prefilled,
        "tokens_reused": stats.tokens_reused,
        "ttft_mean_s": statistics.fmean(all_ttft),
        "ttft_p90_s": sorted(all_ttft)[min(len(all_ttft) - 1, int(0.9 * len(all_ttft)))],
        "per_agent_ttft_mean_s": {a: statistics.fmean(v) for a, v in ttft.items()},
        "cache": cache,
    }


def run(rounds: int = 3, fixed_min: int = 1024, fixed_max: int = 2048, suffix_tokens: int = 32,
        max_tokens: int = 16, budget_fraction: float = 0.5, device: str = "cpu", model: str | None = None,
        dtype: str = "float32", slow_tier: str = "auto", bounded: bool = False, seed: int = 0) -> dict[str, Any]:
    from kvbaton.backend import Engine

    probe = Engine(model, dtype=dtype, device=device, kv_budget="1 blocks")
    rng = random.Random(seed)
    fixed = {}
    for i, name in enumerate(AGENTS):
        length = rng.randint(fixed_min, fixed_max)
        text = f"You are the {name} agent of an engineering team. Background notes:\n" + document(length, seed=100 + i)
        fixed[name] = probe.tokenize(text)[:length]
    bytes_per_block = probe.pool.shape.bytes_per_block
    block_size = probe.block_size
    total_fixed_blocks = sum(len(t) // block_size for t in fixed.values())
    budget_blocks = int(total_fixed_blocks * budget_fraction)
    tier_kind = ("host" if device.startswith("cuda") else "disk") if slow_tier == "auto" else slow_tier
    big_tier = f"{tier_kind}:{4 * total_fixed_blocks} blocks"
    small_tier = f"{tier_kind}:{total_fixed_blocks // 4} blocks"
    engine_kwargs = {"model": model, "dtype": dtype, "device": device, "kv_budget": f"{budget_blocks} blocks"}
    variants = [
        Variant("a", "no prefix reuse", {"prefix_cache": False}, hints=False),
        Variant("b", "radix + LRU, no slow tier", {"eviction": "lru"}, hints=False),
        Variant("c", f"LRU + {tier_kind} tier, reactive load", {"eviction": "lru", "tiers": [big_tier],
                                                                 "prefetch": False}, hints=False),
        Variant("d", f"STE + {tier_kind} tier + prefetch", {"eviction": "ste", "tiers": [big_tier]}, hints=True),
    ]
    if bounded:
        variants += [
            Variant("d_bounded", f"STE + small {tier_kind} tier (STE order)", {"eviction": "ste", "tiers": [small_tier]},
                    hints=True),
            Variant("d_bounded_lru_tier", f"STE + small {tier_kind} tier (LRU order)",
                    {"eviction": "ste", "tiers": [small_tier], "tier_eviction": "lru"}, hints=True),
        ]
    order = schedule(rounds, seed)
    rows = [run_variant(v, engine_kwargs, fixed, order, suffix_tokens, max_tokens)
            for v in tqdm(variants, desc="workflow variants", unit="variant")]
    by_key = {r["variant"]: r for r in rows}
    ratios = {
        "b_over_d": by_key["b"]["end_to_end_s"] / by_key["d"]["end_to_end_s"],
        "c_over_d": by_key["c"]["end_to_end_s"] / by_key["d"]["end_to_end_s"],
        "a_over_d": by_key["a"]["end_to_end_s"] / by_key["d"]["end_to_end_s"],
    }
    if bounded:
        ratios["bounded_lru_tier_over_ste_tier"] = (
            by_key["d_bounded_lru_tier"]["end_to_end_s"] / by_key["d_bounded"]["end_to_end_s"]
        )
    return {
        "benchmark": "workflow",
        "model": probe.loaded.name,
        "device": device,
        "dtype": dtype,
        "agents": len(AGENTS),
        "calls": len(order),
        "rounds": rounds,
        "fixed_prompt_tokens": {a: len(t) for a, t in fixed.items()},
        "device_budget_blocks": budget_blocks,
        "fixed_prompt_blocks": total_fixed_blocks,
        "bytes_per_block": bytes_per_block,
        "slow_tier": big_tier,
        "bounded_slow_tier": small_tier if bounded else None,
        "machine": machine_info(),
        "rows": rows,
        "ratios": ratios,
    }


def table(payload: dict[str, Any]) -> str:
    columns = ["variant", "end-to-end s", "prefilled tok", "TTFT mean s", "TTFT p90 s", "hits by tier (blocks)",
               "prefetch hit rate"]
    rows = []
    for r in payload["rows"]:
        cache = r["cache"] or {}
        hits = ", ".join(f"{k}={v}" for k, v in sorted((cache.get("hits_blocks") or {}).items())) or "-"
        rate = f"{cache['prefetch_hit_rate']:.2f}" if cache.get("blocks_prefetched") else "-"
        rows.append([f"({r['variant']}) {r['label']}", r["end_to_end_s"], r["tokens_prefilled"], r["ttft_mean_s"],
                     r["ttft_p90_s"], hits, rate])
    ratios = ", ".join(f"{k} = {v:.2f}x" for k, v in payload["ratios"].items())
    return format_table(columns, rows) + f"\n\nratios: {ratios}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench workflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fixed-min", type=int, default=1024, help="shortest fixed prompt (tokens)")
    parser.add_argument("--fixed-max", type=int, default=2048, help="longest fixed prompt (tokens)")
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--budget-fraction", type=float, default=0.5, help="device KV budget / sum of fixed prompts")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]; on cuda the slow tier is pinned host RAM")
    parser.add_argument("--model", default=None, help="default model or a local checkpoint dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--slow-tier", default="auto", choices=["auto", "host", "disk"])
    parser.add_argument("--bounded", action="store_true", help="also run the bounded-slow-tier ablation")
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args(argv)
    payload = run(args.rounds, args.fixed_min, args.fixed_max, args.suffix_tokens, args.max_tokens,
                  args.budget_fraction, args.device, args.model, args.dtype, args.slow_tier, args.bounded)
    print(table(payload))
    name = "workflow" if args.device == "cpu" else f"workflow-{args.device.replace(':', '')}"
    print(f"\nwritten: {write_results(args.results_dir, name, payload)}")
