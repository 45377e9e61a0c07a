"""``kvbaton bench all``: every registered benchmark, each writing its record (JSON) and a PNG plot,
then the debate example's timeline plot (kvbaton vs the text baseline, ``debate_timeline.png``) and a
summary of the AAFLOW+ experiments they measure.

One suite run is one run id: every benchmark's record goes to ``<results dir>/<run id>/`` (see
:mod:`kvbaton.bench.record`), with ``summary.json`` beside them. A quick run's records say
``"quick": true`` and are never published by ``kvbaton bench report``.

Benchmarks come from the registry (``kvbaton.bench.registry.BENCHMARKS``), so one registered later
runs here too. ``--quick`` runs each with small sizes: a benchmark module may define
``QUICK_ARGS`` (its argv for a small run); the built-in ones are in ``kvbaton.bench.suite.QUICK``; a
benchmark with neither is skipped in quick runs (its full run may be long).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbaton.bench import record
from kvbaton.bench.common import format_table, machine_info
from kvbaton.bench.registry import BENCHMARKS
from tqdm.auto import tqdm

# The experiments of the issue, and the benchmarks that measure each.
EXPERIMENTS: list[tuple[str, tuple[str, ...]]] = [
    ("(1) TTFT vs context length", ("ttft",)),
    ("(2) multi-agent scaling, k = 1..16 agents on one context", ("scaling",)),
    ("(3) transfer vs recompute crossover", ("transfer",)),
    ("(4) peak KV vs branch factor", ("branching",)),
    ("(5) throughput and framework overhead", ("serve", "engine", "adapter_overhead")),
]

QUICK: dict[str, list[str]] = {
    "ttft": ["--lengths", "128", "256", "--repeats", "1", "--no-hf"],
    "serve": ["--levels", "1", "2", "--context-words", "100", "--max-tokens", "2", "--repeats", "1"],
    "engine": ["--dtypes", "float32", "--steps", "4", "--concurrency", "1", "2", "--repeats", "1"],
    "adapter_overhead": ["--repeats", "5"],
    "transfer": ["--lengths", "128", "256", "--ks", "1", "2", "--context", "128", "--max-tokens", "2",
                 "--suffix", "8", "--repeats", "1"],
    "correction": ["--lengths", "128", "--trajectories", "2", "--greedy-tokens", "4"],
    "agents": ["--quick", "--dtypes", "float32"],
    "workflow": ["--rounds", "2", "--fixed-min", "64", "--fixed-max", "96", "--suffix-tokens", "8",
                 "--max-tokens", "2"],
}


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed | skipped
    seconds: float = 0.0
    note: str = ""
    files: list[str] = field(default_factory=list)
    run_dir: str = ""


def registry() -> dict[str, tuple[str, str]]:
    return dict(BENCHMARKS)


def _names(values: Sequence[str] | None) -> list[str]:
    return [n for v in values or () for n in v.replace(",", " ").split()]


def quick_args(name: str, module: Any) -> list[str] | None:
    own = getattr(module, "QUICK_ARGS", None)
    return list(own) if own is not None else QUICK.get(name)


def new_run_id() -> str:
    return record.new_run_id(record.git_state()["short"])


def run_one(name: str, module_name: str, results_dir: Path, quick: bool, extra: Sequence[str] = (),
            run_id: str | None = None) -> Outcome:
    """Run one benchmark's ``main``, its record going to ``results_dir/<run id>/``; plot every
    record it wrote there."""
    from kvbaton.bench.plots import plot

    module = importlib.import_module(module_name)
    run_id = run_id or new_run_id()
    run_dir = Path(results_dir) / run_id
    argv: list[str] = []
    if quick:
        q = quick_args(name, module)
        if q is None:
            return Outcome(name, "skipped", note="no quick configuration (define QUICK_ARGS in its module)")
        argv += [*q, "--quick-record"]
    argv += [*extra, "--results-dir", str(results_dir), "--run-id", run_id]
    print(f"\n=== {name}: {' '.join(argv)}", flush=True)
    before = {p: p.stat().st_mtime_ns for p in run_dir.glob("*.json")}
    start = time.time()
    try:
        module.main(argv)
    except SystemExit as exc:  # argparse errors and explicit exits
        if exc.code not in (0, None):
            return Outcome(name, "failed", time.time() - start, f"exited with {exc.code}", run_dir=str(run_dir))
    except Exception as exc:  # noqa: BLE001 - one failing benchmark must not stop the suite
        traceback.print_exc()
        return Outcome(name, "failed", time.time() - start, f"{type(exc).__name__}: {exc}", run_dir=str(run_dir))
    seconds = time.time() - start
    files = []
    for path in sorted(run_dir.glob("*.json")):
        if before.get(path) != path.stat().st_mtime_ns and path.name != "summary.json":  # written by this run
            payload = json.loads(path.read_text())
            if isinstance(payload, dict):
                payload.setdefault("benchmark", path.stem)
                try:
                    files += [path.name, plot(payload, path.with_suffix(".png")).name]
                except Exception as exc:  # noqa: BLE001 - a plot failure is reported, the data stays
                    files.append(path.name)
                    print(f"plot of {path.name} failed: {type(exc).__name__}: {exc}")
    return Outcome(name, "ok", seconds, files=files, run_dir=str(run_dir))


TIMELINE = "timeline"  # not a benchmark: the debate example's timeline plot, kvbaton vs text baseline
TIMELINE_ARGS = ["--rounds", "2", "--context-words", "600", "--max-tokens", "8"]
TIMELINE_QUICK_ARGS = ["--rounds", "1", "--context-words", "200", "--max-tokens", "4"]


def run_timeline(run_dir: Path, quick: bool) -> Outcome:
    """``kvbaton run debate --plot``: the debate's timeline (kvbaton and the text baseline side by
    side) as ``debate_timeline.png`` in the run's folder (a plot, not a record: the example's numbers)."""
    from kvbaton.examples import debate

    print(f"\n=== {TIMELINE}: kvbaton run debate --plot", flush=True)
    start = time.time()
    png = run_dir / "debate_timeline.png"
    try:
        debate.main([*(TIMELINE_QUICK_ARGS if quick else TIMELINE_ARGS), "--quiet", "--plot", str(png)])
    except Exception as exc:  # noqa: BLE001 - a failing example must not stop the suite
        traceback.print_exc()
        return Outcome(TIMELINE, "failed", time.time() - start, f"{type(exc).__name__}: {exc}", run_dir=str(run_dir))
    return Outcome(TIMELINE, "ok", time.time() - start, files=[png.name], run_dir=str(run_dir))


def run_all(results_dir: str | Path = "results", *, quick: bool = False, only: Sequence[str] = (),
            skip: Sequence[str] = (), run_id: str | None = None) -> list[Outcome]:
    """Every selected benchmark under one run id; ``summary.json`` in ``results_dir/<run id>/``."""
    run_id = run_id or new_run_id()
    out_dir = Path(results_dir) / run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    benches = registry()
    known = {*benches, TIMELINE}
    unknown = sorted(set(only) - known | set(skip) - known)
    if unknown:
        raise SystemExit(f"unknown benchmark(s): {', '.join(unknown)}; registered: {', '.join(sorted(benches))}")
    names = [n for n in benches if (not only or n in only) and n not in skip]
    outcomes = []
    for name in tqdm(names, desc="kvbaton bench all", unit="benchmark"):
        outcomes.append(run_one(name, benches[name][0], Path(results_dir), quick, run_id=run_id))
    for name in benches:
        if name not in names:
            outcomes.append(Outcome(name, "skipped", note="not selected"))
    if (not only or TIMELINE in only) and TIMELINE not in skip:
        outcomes.append(run_timeline(out_dir, quick))
    else:
        outcomes.append(Outcome(TIMELINE, "skipped", note="not selected"))
    summary = {"run_id": run_id, "git": record.git_state(), "machine": machine_info(), "quick": quick,
               "outcomes": [o.__dict__ for o in outcomes], "experiments": experiments(outcomes, benches)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return outcomes


def experiments(outcomes: Sequence[Outcome], benches: dict[str, Any]) -> list[dict[str, str]]:
    by = {o.name: o for o in outcomes}
    rows = []
    for title, names in EXPERIMENTS:
        for name in names:
            if name not in benches:
                status = f"skipped: the {name!r} benchmark is not registered in this build"
            else:
                o = by.get(name)
                status = o.status + (f" ({o.note})" if o and o.note else "") if o else "not run"
            rows.append({"experiment": title, "benchmark": name, "status": status})
    return rows


def print_summary(outcomes: Sequence[Outcome], results_dir: str | Path) -> None:
    benches = registry()
    print("\n=== benchmarks")
    print(format_table(["benchmark", "status", "seconds", "files / note"],
                       [[o.name, o.status, round(o.seconds, 1), ", ".join(o.files) or o.note] for o in outcomes]))
    print("\n=== experiments")
    print(format_table(["experiment", "benchmark", "status"],
                       [[r["experiment"], r["benchmark"], r["status"]] for r in experiments(outcomes, benches)]))
    print(f"\nresults in {results_dir}/ (summary.json, <benchmark>.json records, <benchmark>.png)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes (minutes, not an hour): a smoke run")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks (names or a,b,c)")
    parser.add_argument("--skip", nargs="+", metavar="NAME", help="do not run these benchmarks")
    parser.add_argument("--results-dir", default="results",
                        help="parent folder: records, PNG and summary.json go to DIR/<run id>/ (default results)")
    parser.add_argument("--run-id", default=None, help="run id (folder name); default: UTC time + short commit")
    parser.add_argument("--list", action="store_true", help="list the registered benchmarks and exit")


def run_from_args(args: argparse.Namespace) -> int:
    if args.list:
        for name, (module, text) in registry().items():
            print(f"{name:18s} {text}  [{module}]")
        return 0
    run_id = args.run_id or new_run_id()
    outcomes = run_all(args.results_dir, quick=args.quick, only=_names(args.only), skip=_names(args.skip),
                       run_id=run_id)
    print_summary(outcomes, Path(args.results_dir) / run_id)
    return 1 if any(o.status == "failed" for o in outcomes) else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvbaton bench all", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run_from_args(parser.parse_args(argv)))
