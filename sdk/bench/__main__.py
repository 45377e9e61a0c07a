"""``python -m kvbaton.bench <name>``: run one benchmark, print its table, write its record;
``all``: the suite; ``report``: regenerate the published results from the committed records."""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = {
    "serve": ("kvbaton.bench.serve", "kvbaton serve: throughput and TTFT at 1/8/32 clients, reuse on vs off"),
    "ttft": ("kvbaton.bench.ttft", "TTFT: text replay vs resume from a handle vs the question-only floor"),
    "adapter_overhead": ("kvbaton.bench.adapter_overhead", "LangGraph adapter overhead per LLM call (no model time)"),
    "engine": ("kvbaton.bench.engine", "engine speed vs plain transformers: prefill, decode, batched decode"),
    "transfer": ("kvbaton.bench.transfer", "multi-device: KV transfer vs recompute crossover, fork across workers vs replay"),
    "correction": ("kvbaton.bench.correction", "shared segments behind different prefixes: dense / rotation / anchor correction"),
    "agents": ("kvbaton.bench.agents", "persona-first debate / chain / fan-out: exact vs auto vs rotate reuse vs text replay"),
    "workflow": ("kvbaton.bench.workflow", "10-agent cyclic workflow: no reuse / LRU / LRU+tier / STE+prefetch"),
    "scaling": ("kvbaton.bench.scaling", "k = 1..16 agents on one shared context: text replay vs forked handles"),
    "branching": ("kvbaton.bench.branching", "peak KV vs branch factor of a tree search: copies vs forks"),
    "soak": ("kvbaton.bench.soak", "64 clients, dropped streams, a full tier, a worker kill, a restart: leaks must be 0"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["all"]:  # every benchmark, JSON + PNG each (kvbaton.bench.suite)
        from kvbaton.bench.suite import main as run_all

        run_all(argv[1:])
        return
    if argv[:1] == ["report"]:  # docs/results.md and the README headline from the committed records
        from kvbaton.bench.report import main as report

        raise SystemExit(report(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench", description="kvbaton benchmarks")
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="; ".join(f"{k}: {v[1]}" for k, v in BENCHMARKS.items()))
    args, rest = parser.parse_known_args(argv[:1])
    importlib.import_module(BENCHMARKS[args.name][0]).main(argv[1:])


if __name__ == "__main__":
    main()
