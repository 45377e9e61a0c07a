"""``python -m kvbaton.bench <name>``: run one benchmark, print its table, write its record;
``all``: the suite; ``report``: regenerate the published results from the committed records."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvbaton.bench.registry import BENCHMARKS


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
