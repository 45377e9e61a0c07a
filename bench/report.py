"""``python -m kvbaton.bench report``: the published results, generated from the committed records.

Reads ``benchmarks/records/<run id>/<name>.json`` (records copied there from ``results/`` and
committed; quick and partial records are skipped; per benchmark the newest record wins) and
rewrites what lies between marker comments::

    docs/results.md   <!-- bench:<name>:start --> ... <!-- bench:<name>:end -->  (one per benchmark, and "summary")
    README.md         <!-- bench:headline:start --> ... <!-- bench:headline:end -->

Everything between markers is generated; the prose around them is hand-written and states no
measured numbers. Each generated block names its run id and commit. A record is *current* when no
code (``CODE_PATHS``) changed between its commit and HEAD; otherwise its numbers are marked
"(older commit <sha>)" — so after a code change, re-run the benchmark, commit the record, and
regenerate. A benchmark without a record says "not yet measured on the current code". Also draws
each record's plot to ``docs/img/bench/<name>.png`` (``--no-plots`` skips it).

``--check`` writes nothing and exits 1 when a file would change (CI; tests/test_bench_records.py
does the same in memory).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbaton.bench.headline import headline, reasons, targets
from kvbaton.bench.record import OTHER_CPU_LIMIT, REPO_ROOT

Record = dict[str, Any]
RECORDS_DIR = Path("benchmarks") / "records"
RESULTS_MD = Path("docs") / "results.md"
README = Path("README.md")
PLOTS_DIR = Path("docs") / "img" / "bench"
# The code whose change makes a record's numbers stale (the report and plot modules draw, they do not measure).
CODE_PATHS = ("backend", "adapters", "sdk", "bench", ":(exclude)bench/report.py", ":(exclude)bench/headline.py",
              ":(exclude)bench/plots.py")
# Order of the sections in docs/results.md: benchmark name -> (module, table function).
SECTIONS: dict[str, tuple[str, str]] = {
    "ttft": ("kvbaton.bench.ttft", "table"),
    "workflow": ("kvbaton.bench.workflow", "table"),
    "correction": ("kvbaton.bench.correction", "table"),
    "agents": ("kvbaton.bench.agents_table", "table"),
    "family": ("kvbaton.bench.family_table", "table"),
    "scaling": ("kvbaton.bench.scaling", "table"),
    "branching": ("kvbaton.bench.branching", "table"),
    "transfer": ("kvbaton.bench.transfer", "table"),
    "ingress": ("kvbaton.bench.ingress", "table"),
    "serve": ("kvbaton.bench.serve", "table"),
    "engine": ("kvbaton.bench.engine", "table"),
    "host": ("kvbaton.bench.host", "table"),
    "concurrency": ("kvbaton.bench.concurrency", "table"),
    "concurrency_tiny": ("kvbaton.bench.concurrency", "table"),
    "adapter_overhead": ("kvbaton.bench.adapter_overhead", "table"),
    "soak": ("kvbaton.bench.soak", "table"),
    "gpu": ("kvbaton.bench.gpu", "table"),
}
# The README's headline benchmarks, in order; the first (agents: kvbaton vs vLLM-CPU on persona-first
# agents) leads the block, above the TTFT table.
README_BENCHMARKS = ("agents", "ttft", "serve", "engine", "workflow", "correction")
MIB = 2**20
MEDIANS = "Median of the repeats, [min–max] beside it; ratios are ratios of medians."


# -- records and their provenance -------------------------------------------------------------------


def select(records_dir: Path) -> dict[str, Record]:
    """The newest publishable record of each benchmark under ``records_dir`` (by file name)."""
    found: dict[str, Record] = {}
    for path in sorted(records_dir.glob("*/*.json")):
        if path.name == "summary.json":
            continue
        rec = json.loads(path.read_text())
        if not isinstance(rec, dict) or rec.get("quick") or rec.get("partial") or "run_id" not in rec:
            continue
        name = path.stem
        old = found.get(name)
        if old is None or (rec.get("date", ""), rec["run_id"]) > (old.get("date", ""), old["run_id"]):
            found[name] = rec
    return found


def _finished(rec: Record) -> set[str]:
    """The phases a phased record measured (finished, or stopped by its budget keeping what it got)."""
    return {name for name, phase in (rec.get("phases") or {}).items()
            if str(phase.get("status", "")) == "ok" or str(phase.get("status", "")).startswith("stopped before")}


def phased_runs(records_dir: Path, name: str = "gpu") -> list[Record]:
    """The runs a phased benchmark's page shows, newest first: the GPU benchmark runs phase by phase on a
    machine lent for minutes, so the newest record of each phase is kept (a run is shown while it has a
    phase no newer run measured), each with its own table, never mixed into another run's rows."""
    runs = sorted((json.loads(p.read_text()) for p in records_dir.glob(f"*/{name}.json")),
                  key=lambda r: (r.get("date", ""), r.get("run_id", "")), reverse=True)
    kept, covered = [], set()
    for rec in runs:
        if not isinstance(rec, dict) or rec.get("quick") or rec.get("partial") or "run_id" not in rec:
            continue
        if _finished(rec) - covered:
            kept.append(rec)
            covered |= _finished(rec)
    return kept


def combined(runs: Sequence[Record]) -> Record:
    """One view of several runs of a phased benchmark for its headline and targets: each phase and its rows
    from the newest run that measured it; the run ids of all."""
    view = dict(runs[0])
    phases: dict[str, Any] = {}
    rows: list[Any] = []
    for rec in runs:
        new = _finished(rec) - set(phases)
        phases.update({phase: rec["phases"][phase] for phase in new})
        rows += [row for row in rec.get("rows", []) if f"speed-{row.get('shape')}" in new]
    view.update(phases=phases, rows=rows, run_id=" + ".join(r["run_id"] for r in runs))
    return view


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)


def staleness(rec: Record, root: Path) -> str:
    """"" when the record measured HEAD's code; else the marker its numbers carry."""
    git = rec.get("git") or {}
    commit, short = git.get("commit"), git.get("short") or "?"
    if not commit:
        return f" (commit unknown{': dirty tree' if git.get('dirty') else ''})"
    if _git(root, "merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
        return f" (older commit {short}, not in this history)"
    changed = _git(root, "diff", "--quiet", commit, "HEAD", "--", *CODE_PATHS).returncode != 0
    dirty = " (run with uncommitted changes)" if git.get("dirty") else ""
    return (f" (older commit {short})" if changed else "") + dirty


def provenance(rec: Record, stale: str) -> str:
    git = rec.get("git") or {}
    load = rec.get("load") or {}
    if not load.get("overloaded"):
        busy = ""
    elif "other_cpu_share" in load:
        busy = f"; **other processes used {load['other_cpu_share']:.0%} of the CPU during the run: times suspect**"
    else:
        busy = (f"; **load above the {load.get('cores')} cores during the run (highest 1-minute load "
                f"{load.get('max_1min_during')}): times suspect**")
    return f"run `{rec['run_id']}`, commit `{git.get('short') or '?'}`{stale}{busy}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.0f} MiB"


def run_header(rec: Record, stale: str) -> str:
    """Where the numbers come from: run, commit, command, machine, dtypes, load and memory."""
    m, load, mem = rec.get("machine") or {}, rec.get("load") or {}, rec.get("memory") or {}
    flags = ", ".join(m.get("cpu_flags") or []) or "no AVX2/AVX512 flags read"
    gib = f", {m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else ""
    lines = [
        f"- Measured in {provenance(rec, stale)}, {rec.get('date', '?')}, {rec.get('wall_s', 0) / 60:.1f} minutes: "
        f"`{shlex.join(rec.get('command') or [])}`.",
        f"- Machine: {m.get('cpu', '?')} ({flags}), {m.get('cores', '?')} cores{gib}, "
        + (f"GPU {m['gpu']}, " if m.get("gpu") else "")
        + f"torch {m.get('torch', '?')} with {m.get('torch_threads', '?')} threads, Python {m.get('python', '?')}; "
        f"dtype {', '.join(rec.get('dtypes') or ['?'])}.",
    ]
    if load:
        text = (f"- Load average (1/5/15 min) before {' / '.join(map(str, load['before']))}, after "
                f"{' / '.join(map(str, load['after']))}, highest 1-minute value during the run {load['max_1min_during']}")
        if "other_cpu_share" in load:  # the load average counts the run's own threads: CPU time decides
            text += (f" (the run's own threads count in it). Other processes used {load['other_cpu_s']:g} s of CPU "
                     f"time, {load['other_cpu_share']:.1%} of the {load['cores']} cores' time")
            text += (f": **above the {OTHER_CPU_LIMIT:.0%} limit, other work competed with this run; treat its times "
                     "as suspect.**" if load.get("overloaded") else f" (within the {OTHER_CPU_LIMIT:.0%} limit).")
        else:
            text += (f": **above the {load['cores']} cores, other work competed with this run; treat its times as "
                     "suspect.**" if load.get("overloaded") else f" (within the {load['cores']} cores).")
        lines.append(text)
    if mem:
        kv = mem.get("peak_kv_bytes")
        lines.append(f"- Memory: process peak RSS {_mib(mem.get('peak_rss_bytes'))} (VmHWM {_mib(mem.get('vm_hwm_bytes'))}"
                     + (f", child processes at most {_mib(mem['children_peak_rss_bytes'])}"
                        if mem.get("children_peak_rss_bytes") else "") + "); KV pool high-water mark "
                     + (f"{_mib(kv)} (sampled every 50 ms)" if kv is not None else "not sampled in this process") + ".")
    return "\n".join(lines)


def not_measured(name: str) -> str:
    return f"Not yet measured on the current code: run `python -m kvbaton.bench {name}`."


# -- the generated blocks ---------------------------------------------------------------------------


def table_of(name: str, rec: Record) -> str:
    module, function = SECTIONS[name]
    draw: Callable[..., str] = getattr(importlib.import_module(module), function)
    # The gate-threshold simulation is not a measurement: results never publish it.
    return draw(rec, simulated=False) if name == "correction" else draw(rec)


def section(name: str, rec: Record | None, stale: str, runs: Sequence[tuple[Record, str]] = ()) -> str:
    """A benchmark's block: its run's header, table and notes (each of ``runs``' for a phased benchmark,
    newest first), then the targets of ``rec`` (for a phased benchmark, the view of all its runs)."""
    if rec is None:
        return not_measured(name)
    module = importlib.import_module(SECTIONS[name][0])
    # A benchmark that summarises otherwise says so (correction: means over its prompts).
    summary_line = getattr(module, "SUMMARY", MEDIANS)
    extra = getattr(module, "notes", None)
    parts: list[str] = []
    for run, run_stale in runs or [(rec, stale)]:
        if parts:
            parts += ["", f"Phases of an earlier run that the run above did not measure (run `{run['run_id']}`):", ""]
        parts += [run_header(run, run_stale), "", summary_line, "", table_of(name, run)]
        if extra is not None:  # a benchmark's lines under its table (engine: kernels, agreement, floor)
            parts += ["", *(f"- {line}" for line in extra(run))]
    found = targets(rec)
    if found:
        parts += ["", *(t.line() for t in found)]
        parts += [f"- {line}" for line in reasons(rec)]
    parts += ["", f"![{name}](img/bench/{name}.png)"]
    return "\n".join(parts)


EXPERIMENTS = [
    ("(1) TTFT vs context length", "ttft"), ("(2) multi-agent scaling", "scaling"),
    ("(3) transfer vs recompute crossover", "transfer"), ("(4) peak KV vs branch factor", "branching"),
    ("(5) serving throughput", "serve"), ("(5) engine speed", "engine"), ("(5) framework overhead", "adapter_overhead"),
    ("workflow-aware cache", "workflow"), ("shared segments", "correction"),
    ("persona-first multi-agent reuse", "agents"), ("the engine on a GPU", "gpu"),
]


def summary(records: Mapping[str, Record], stale: Mapping[str, str]) -> str:
    rows = ["| experiment | benchmark | headline (medians unless it says means) | run |", "|---|---|---|---|"]
    for title, name in EXPERIMENTS:
        rec = records.get(name)
        text = headline(rec) if rec else not_measured(name)
        run = provenance(rec, stale[name]) if rec else "-"
        rows.append(f"| {title} | [`{name}`](#{name}) | {text} | {run} |")
    return "\n".join(rows)


def readme(records: Mapping[str, Record], stale: Mapping[str, str]) -> str:
    """The README's headline block: the first headline benchmark's line (the agents comparison), the
    TTFT table, then one line per other headline benchmark."""
    def line(name: str) -> str:
        rec = records.get(name)
        return f"- `{name}`: " + (f"{headline(rec)} ({provenance(rec, stale[name])})" if rec else not_measured(name))

    lead, *others = README_BENCHMARKS
    parts = [line(lead), ""]
    ttft = records.get("ttft")
    if ttft:
        parts += [f"Time to first token, {provenance(ttft, stale['ttft'])} "
                  f"(`python -m kvbaton.bench ttft`; machine and spread in [docs/results.md](docs/results.md#ttft)):",
                  "", table_of("ttft", ttft), ""]
    parts += [line(name) for name in others]
    parts += ["", "Every number above is generated from a committed record by `python -m kvbaton.bench report`; "
              "how to read and reproduce them: [docs/results.md](docs/results.md)."]
    return "\n".join(parts)


# -- filling the marked blocks ----------------------------------------------------------------------


def fill(text: str, blocks: Mapping[str, str], path: str = "") -> str:
    """``text`` with each ``<!-- bench:NAME:start -->...end`` block replaced by ``blocks[NAME]``."""
    for name, body in blocks.items():
        pattern = re.compile(rf"(<!-- bench:{re.escape(name)}:start -->\n)(?:.*?\n)?(<!-- bench:{re.escape(name)}:end -->)",
                             re.DOTALL)
        if not pattern.search(text):
            raise SystemExit(f"{path}: no <!-- bench:{name}:start --> / end markers")
        text = pattern.sub(lambda m, body=body: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text)
    return text


def generate(root: Path = REPO_ROOT, records_dir: Path | None = None) -> dict[Path, str]:
    """The new text of docs/results.md and README.md (paths relative to ``root``), in memory."""
    records = select(root / (records_dir or RECORDS_DIR))
    runs = phased_runs(root / (records_dir or RECORDS_DIR))
    if runs:
        records["gpu"] = combined(runs)
    stale = {name: staleness(rec, root) for name, rec in records.items()}
    for name in {*SECTIONS, *README_BENCHMARKS} - set(records):
        stale[name] = ""
    results = {name: section(name, records.get(name), stale[name]) for name in SECTIONS}
    if runs:
        results["gpu"] = section("gpu", records["gpu"], stale["gpu"], [(run, staleness(run, root)) for run in runs])
    results["summary"] = summary(records, stale)
    return {
        RESULTS_MD: fill((root / RESULTS_MD).read_text(), results, str(RESULTS_MD)),
        README: fill((root / README).read_text(), {"headline": readme(records, stale)}, str(README)),
    }


def draw_plots(root: Path, records_dir: Path | None = None) -> list[Path]:
    from kvbaton.bench.plots import plot

    records = select(root / (records_dir or RECORDS_DIR))
    runs = phased_runs(root / (records_dir or RECORDS_DIR))
    if runs:
        records["gpu"] = combined(runs)
    return [plot(rec, root / PLOTS_DIR / f"{name}.png") for name, rec in records.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbaton bench report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (default: this checkout)")
    parser.add_argument("--records-dir", type=Path, default=None,
                        help=f"records folder, relative to the root (default {RECORDS_DIR})")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    parser.add_argument("--no-plots", action="store_true", help="do not redraw docs/img/bench/<name>.png")
    args = parser.parse_args(argv)
    stale = []
    for rel, text in generate(args.root, args.records_dir).items():
        path = args.root / rel
        if path.read_text() != text:
            stale.append(str(rel))
            if not args.check:
                path.write_text(text)
    if args.check:
        print("out of date: " + ", ".join(stale) if stale else "up to date")
        return 1 if stale else 0
    if not args.no_plots:
        for path in draw_plots(args.root, args.records_dir):
            print(f"drew {path}")
    print("rewrote " + ", ".join(stale) if stale else "already up to date")
    return 0
