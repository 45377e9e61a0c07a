"""The JSON record of one benchmark run: what ran, on which code and machine, under what load, and
every repeat it measured.

One run of a benchmark writes ONE record, ``<results dir>/<run id>/<name>.json``. The run id is the
UTC start time plus the short commit (``20261201T031500Z-42f0eb7``); ``kvbaton bench all`` gives
every benchmark of the suite the same run id, so one folder holds one run of the suite. A record is
the benchmark's own payload (its ``rows``, with the raw repeats and min/median/max of
:mod:`kvbaton.bench.spread`) plus, under fixed keys, the metadata written here:

- ``schema``, ``benchmark``, ``run_id``, ``command`` (argv), ``git`` (commit, short, dirty),
  ``date`` (UTC, start), ``wall_s``, ``dtypes``, ``quick`` (a smoke run: never published);
- ``machine``: CPU model and the flags that decide fp32/bf16 speed, cores, memory, torch version
  and threads, Python;
- ``load``: 1/5/15-minute load averages before and after and the highest 1-minute average seen while
  it ran (the run's own threads count in these); ``other_cpu_s`` / ``other_cpu_share``: the CPU time
  that processes other than this one and its waited-for children used while it ran (steal time of
  the VM included), and its share of the cores' time; ``overloaded`` when that share exceeded
  ``OTHER_CPU_LIMIT`` (the numbers are then suspect). Where the CPU time cannot be read (not Linux),
  ``overloaded`` falls back to the load average exceeding the core count;
- ``memory``: process peak RSS (``ru_maxrss`` and ``VmHWM``; of this process, its whole life, model
  load included; waited-for children separately, an upper bound), and ``peak_kv_bytes``: the KV pool high-water mark sampled
  every ``SAMPLE_S`` while the benchmark ran (the sum over the engines it watched; None when the
  benchmark's engines live in other processes and were not watched).

``results/`` is scratch output (gitignored); records worth publishing are copied to
``benchmarks/records/<run id>/`` and committed (docs/results.md says how).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SCHEMA = 1
SAMPLE_S = 0.05
# Share of the cores' time other processes may take during a run before its times are suspect: the
# kernel's own threads and the shell take well under 1% on an idle machine.
OTHER_CPU_LIMIT = 0.10
REPO_ROOT = Path(__file__).resolve().parents[1]
META_KEYS = ("schema", "benchmark", "run_id", "command", "git", "date", "wall_s", "dtypes", "quick", "partial",
             "machine", "load", "memory")
Poll = Callable[[], "int | Mapping[Any, int]"]


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit (full and short) and whether the work tree had changes; None values outside a git checkout, unless
    ``$KVBATON_GIT_COMMIT`` (and ``$KVBATON_GIT_DIRTY``, 0 or 1) name them: a copy of a checkout run elsewhere
    without its ``.git`` (the GPU run, scripts/gpu_run.sh)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    if commit is None and os.environ.get("KVBATON_GIT_COMMIT"):
        commit, dirty = os.environ["KVBATON_GIT_COMMIT"], os.environ.get("KVBATON_GIT_DIRTY")
        return {"commit": commit, "short": commit[:7], "dirty": None if dirty is None else dirty == "1"}
    return {"commit": commit, "short": commit[:7] if commit else None,
            "dirty": None if status is None else bool(status)}


def new_run_id(short_commit: str | None, when: dt.datetime | None = None) -> str:
    when = when or dt.datetime.now(dt.UTC)
    return f"{when.strftime('%Y%m%dT%H%M%SZ')}-{short_commit or 'nogit'}"


def proc_status_bytes(pid: int | str, field: str) -> int | None:
    """A memory figure of a process from /proc/<pid>/status (``VmHWM``, ``VmRSS``...) in bytes, None
    where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def vm_hwm_bytes(pid: int | str = "self") -> int | None:
    """A process's peak resident memory (``VmHWM`` of /proc/<pid>/status), None where unreadable."""
    return proc_status_bytes(pid, "VmHWM")


def process_memory() -> dict[str, int | None]:
    """Peak resident memory of this process (two sources) and of its waited-for children, in bytes.
    The children's figure is an upper bound: on Linux a forked child counts the parent's pages until
    it execs, so it is at least this process's RSS at the fork."""
    kib = 1024  # ru_maxrss is in KiB on Linux
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib, "vm_hwm_bytes": vm_hwm_bytes(),
            "children_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib or None}


class PeakSampler:
    """A background thread that polls byte counts every ``interval`` s and keeps their high-water
    marks: ``peak[name]`` per poll (``peak["name:key"]`` for a poll answering a mapping), ``total``
    for their sum at one instant. A poll that raises
    (its engine closed) is dropped. Also keeps the highest 1-minute load average it saw.

    Used as a context manager around one phase (a row's peak), or by a :class:`Recording` for
    the whole run."""

    def __init__(self, polls: Mapping[str, Poll] | None = None, interval: float = SAMPLE_S) -> None:
        self.interval = interval
        self._polls: dict[str, Poll] = dict(polls or {})
        self.peak: dict[str, int] = {}
        self.total = 0
        self.max_load = os.getloadavg()[0]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, name: str, poll: Poll) -> None:
        with self._lock:
            self._polls[name] = poll

    def sample(self) -> None:
        with self._lock:
            polls = list(self._polls.items())
        now = 0
        for name, poll in polls:
            try:
                value = poll()
                # a poll may answer several byte counts at once (a cluster: one per worker)
                values = {f"{name}:{k}": int(v) for k, v in value.items()} if isinstance(value, Mapping) else {
                    name: int(value)}
            except Exception:  # noqa: BLE001 - a closed engine stops being watched
                with self._lock:
                    self._polls.pop(name, None)
                continue
            for key, v in values.items():
                now += v
                self.peak[key] = max(self.peak.get(key, 0), v)
        self.total = max(self.total, now)
        self.max_load = max(self.max_load, os.getloadavg()[0])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> PeakSampler:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="kvbaton-bench-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def __enter__(self) -> PeakSampler:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pool_bytes(engine: Any) -> Poll:
    """The poll of one engine's KV pool: bytes of blocks in use now."""
    return lambda: engine.stats().pool_bytes_used


_active: list[Recording] = []


def watch_kv(name: str, poll: Poll) -> None:
    """Have the running benchmark's record sample ``poll`` (KV bytes in use) until the run ends;
    nothing when no record is being made (``run()`` called directly, in tests)."""
    if _active:
        _active[-1].sampler.add(name, poll)


_unreaped_cpu_s = [0.0]  # see note_own_cpu


def note_own_cpu(seconds: float) -> None:
    """``seconds`` of CPU that processes this run started used and that the kernel will not count as waited-for
    children of this process (a peer server's workers killed with its process group, never reaped by us):
    :func:`cpu_seconds` counts them as this run's own, not as other load on the machine."""
    _unreaped_cpu_s[0] += max(0.0, seconds)


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy since boot, steal time included; CPU seconds of
    this process and its waited-for children). None where /proc/stat cannot be read."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    fields += [0] * (8 - len(fields))
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    own = os.times()
    return ((user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
            own.user + own.system + own.children_user + own.children_system + _unreaped_cpu_s[0])


def other_cpu_seconds(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """CPU time used between two :func:`cpu_seconds` readings by everything but this process and its
    waited-for children (a child still running when ``after`` is read counts as other work)."""
    if before is None or after is None:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1]))


def load_state(before: tuple[float, ...], after: tuple[float, ...], max_during: float, cores: int | None,
               other_cpu_s: float | None = None, wall_s: float | None = None) -> dict[str, Any]:
    """The ``load`` block: averages before/after, the highest seen, the CPU time other processes used, and
    whether the run was overloaded: by that CPU time where measured, else by the load average."""
    highest = max(max_during, before[0], after[0])
    state: dict[str, Any] = {"before": [round(x, 2) for x in before], "after": [round(x, 2) for x in after],
                             "max_1min_during": round(highest, 2), "cores": cores,
                             "overloaded": bool(cores) and highest > cores}
    if other_cpu_s is not None and cores and wall_s:
        share = other_cpu_s / (cores * wall_s)
        state.update(other_cpu_s=round(other_cpu_s, 1), other_cpu_share=round(share, 4),
                     overloaded=share > OTHER_CPU_LIMIT)
    return state


class Recording:
    """One benchmark run being recorded: start it before the benchmark runs, ``write`` its payload."""

    def __init__(self, benchmark: str, results_dir: str | os.PathLike[str] = "results", run_id: str | None = None,
                 argv: list[str] | None = None, quick: bool = False, name: str | None = None) -> None:
        self.benchmark = benchmark
        self.name = name or benchmark
        self.git = git_state()
        self.run_id = run_id or new_run_id(self.git["short"])
        self.out_dir = Path(results_dir) / self.run_id
        self.command = ["python", "-m", "kvbaton.bench", benchmark, *(sys.argv[1:] if argv is None else argv)]
        self.quick = quick
        self.sampler = PeakSampler()
        self.date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.load_before = os.getloadavg()
        self.cpu_before = cpu_seconds()
        self.started = time.perf_counter()

    @classmethod
    def from_args(cls, benchmark: str, args: argparse.Namespace, argv: list[str] | None,
                  name: str | None = None) -> Recording:
        return cls(benchmark, args.results_dir, args.run_id, argv, quick=args.quick_record, name=name)

    def __enter__(self) -> Recording:  # noqa: PYI034
        self.sampler.start()
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _active:
            _active.remove(self)
        self.sampler.stop()

    def metadata(self, dtypes: list[str], partial: bool = False, machine: Mapping[str, Any] | None = None
                 ) -> dict[str, Any]:
        from kvbaton.bench.common import machine_info  # torch: imported when a record is written

        machine = {**machine_info(), **(machine or {})}
        memory: dict[str, Any] = dict(process_memory())
        memory["peak_kv_bytes"] = self.sampler.total if self.sampler.peak else None
        memory["peak_kv_bytes_by_engine"] = dict(self.sampler.peak)
        wall_s = time.perf_counter() - self.started
        other = other_cpu_seconds(self.cpu_before, cpu_seconds())
        return {
            "schema": SCHEMA, "benchmark": self.benchmark, "run_id": self.run_id, "command": self.command,
            "git": self.git, "date": self.date, "wall_s": wall_s,
            "dtypes": dtypes, "quick": self.quick, "partial": partial, "machine": machine,
            "load": load_state(self.load_before, os.getloadavg(), self.sampler.max_load, machine["cores"],
                               other, wall_s),
            "memory": memory,
        }

    def write(self, payload: dict[str, Any], dtypes: list[str] | None = None, partial: bool = False,
              machine: Mapping[str, Any] | None = None) -> Path:
        """Write the record (payload + metadata; the metadata keys win). ``partial``: a long run's
        intermediate write, overwritten by the final one. ``machine``: facts the host's description lacks
        (a GPU benchmark's ``gpu``), added to the record's ``machine``."""
        self.sampler.sample()
        found = dtypes or payload.get("dtypes") or [payload.get("dtype") or "float32"]
        record = {**payload, **self.metadata(list(found), partial, machine)}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{self.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        tmp.replace(path)
        return path


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--results-dir`` and ``--run-id``, the same for every benchmark; its help as ``kvbaton bench
    NAME --help`` shows it (that usage line, plain text)."""
    from kvbaton.helptext import plain_formatter

    parser.prog = f"kvbaton bench {name}"
    parser.formatter_class = plain_formatter(parser.formatter_class)
    parser.add_argument("--results-dir", default="results",
                        help=f"parent folder: the record goes to DIR/<run id>/{name}.json (default results)")
    parser.add_argument("--run-id", default=None,
                        help="run id (folder name); default: UTC time + short commit. bench all passes one")
    parser.add_argument("--quick-record", action="store_true", help=argparse.SUPPRESS)  # set by `bench all --quick`


def measure_and_write(parser: argparse.ArgumentParser, name: str, argv: list[str] | None,
                      measure: Callable[[argparse.Namespace], dict[str, Any]],
                      table: Callable[[dict[str, Any]], str]) -> None:
    """The ``main`` of a benchmark that prints one table: the record's options added to ``parser``,
    the arguments parsed, ``measure(args)`` run under a :class:`Recording`, its table printed, its
    record written."""
    add_arguments(parser, name)
    args = parser.parse_args(argv)
    with Recording.from_args(name, args, argv) as rec:
        payload = measure(args)
        print(table(payload))
        print(f"\nwritten: {rec.write(payload)}")


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
