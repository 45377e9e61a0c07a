"""Helpers shared by the benchmark scripts: machine facts, threads, timing, tables.

Records of runs (what a benchmark writes) are :mod:`kvbaton.bench.record`; ``write_results`` stays
for scripts that write a plain JSON file.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                # The instruction sets that decide fp32 vs bf16 speed (dtype="auto" reads the same flags).
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have]
                break
    except OSError:
        pass
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": memory,
        "cpu_flags": flags,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def parallel(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run every function in its own thread (concurrent requests); their results, or the first error."""
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def repeat_times(fn: Callable[[], Any], repeats: int, cleanup: Callable[[Any], None] | None = None) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (``cleanup`` gets each call's result, untimed)."""
    times = []
    for _ in range(repeats):
        seconds, out = timed(fn)
        times.append(seconds)
        if cleanup is not None:
            cleanup(out)
    return times


def alternating(repeats: int, sides: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Every side once per repeat, in turn, so that drift (thermal, page cache) hits all sides alike."""
    runs: dict[str, list[Any]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, run in sides.items():
            runs[side].append(run())
    return runs


# What a table or headline says where an older record lacks a quantity later benchmarks measure.
NOT_MEASURED = "not measured in this record"


def rate(bytes_per_s: float | None) -> str:
    """A link speed in words: ``100 MB/s``, not ``1e+08 B/s`` (None: the unpaced link)."""
    if bytes_per_s is None:
        return "unpaced"
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    head = "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    # Text columns read better left-aligned, numbers right-aligned.
    body = [
        "| " + " | ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) + " |"
        for r in cells
    ]
    return "\n".join([head, rule, *body])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if value < 100 else f"{value:.1f}"
    return str(value)


def write_results(results_dir: str | os.PathLike[str], name: str, payload: dict[str, Any]) -> Path:
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
