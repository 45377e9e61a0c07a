"""Each phase of the GPU benchmark (:mod:`kvbaton.bench.gpu`) in a process of its own, under a hard time limit.

A phase's budget used to be checked only between its measurements, so a slow step could overrun it (the 8B
phase ran 124 s of 110). Now the run's process starts ``python -m kvbaton.bench.gpu --phase-child NAME``,
which measures and writes what it has to a JSON file after every step and every row (:class:`.gpu_harness.Phase`),
and it is stopped when its budget is spent: SIGTERM first (the phase records where it stopped and unwinds,
closing its engines), SIGKILL :data:`GRACE_S` seconds later if it is still there. The record then says the phase
was stopped at its limit, and keeps every row it had written. A process per phase also gives each phase the
whole GPU (its memory, its CUDA context) and makes its Triton and CUDA set-up part of its own budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Nothing here imports torch: a phase's process is started, timed and stopped by a light parent.

GRACE_S = 15.0  # after SIGTERM, the phase's time to record where it stopped and close its engines


class PhaseOverrun(RuntimeError):
    """A phase used up its time budget: it stops where it is, keeping what it measured."""


class Phase:
    """One phase's budget and results (``out`` fills as it measures, so a stopped phase keeps its part).
    ``save`` writes ``out`` where the run's process reads it: after every :meth:`check` and every :meth:`add`."""

    def __init__(self, name: str, budget_s: float, save: Callable[[dict[str, Any]], None] = lambda out: None) -> None:
        self.name = name
        self.budget_s = budget_s
        self.started = time.perf_counter()
        self.out: dict[str, Any] = {"budget_s": round(budget_s, 1), "status": "running", "rows": []}
        self._save = save

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def save(self) -> None:
        self._save(self.out)

    def check(self, next_step: str) -> None:
        """Stop the phase before ``next_step`` if its budget is spent (what it measured is saved either way)."""
        self.out["reached"] = next_step
        self.save()
        if self.left() <= 0:
            raise PhaseOverrun(f"stopped before {next_step}: over its {self.budget_s:.0f} s budget")

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        """A measured table row (saved at once)."""
        self.out["rows"].append(row)
        self.save()
        return row


def run_phase(name: str, budget_s: float, child_args: Sequence[str], *, grace_s: float = GRACE_S,
              launcher: Sequence[str] = (sys.executable, "-m", "kvbaton.bench.gpu")) -> dict[str, Any]:
    """Run phase ``name`` in a process of its own (``launcher`` with ``child_args`` and the phase's) for at most
    ``budget_s`` seconds, then stop it (see the module); its result: the phase's ``out`` (status, seconds,
    rows...), plus ``environment`` and ``checkpoints`` as the phase's process saw them."""
    with tempfile.TemporaryDirectory(prefix=f"kvbaton-gpu-{name}-") as tmp:
        result_file = Path(tmp) / "phase.json"
        command = [*launcher, *child_args, "--phase-child", name, "--child-out", str(result_file),
                   "--child-budget", f"{budget_s:.1f}"]
        started = time.perf_counter()
        process = subprocess.Popen(command)  # its output goes to the run's own (the log)
        stopped = False
        try:
            process.wait(timeout=max(budget_s, 1.0))
        except subprocess.TimeoutExpired:
            stopped = True
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        wall = time.perf_counter() - started
        saved = _read(result_file)
    out: dict[str, Any] = saved.get("out") or {"budget_s": round(budget_s, 1), "rows": []}
    status = str(out.get("status", "running"))
    if status == "running":  # it never wrote an end: killed, or crashed
        if stopped:
            reached = out.get("reached") or "its first step"
            out["status"] = f"stopped before {reached}: killed at its {budget_s:.0f} s hard limit"
        else:
            out["status"] = f"failed: its process exited with code {process.returncode} (see the run's log)"
    elif stopped and not status.startswith("stopped"):
        out["status"] = f"stopped before its end: at its {budget_s:.0f} s hard limit"
    out["seconds"] = round(wall, 1)
    out["budget_s"] = round(budget_s, 1)
    out["hard_limit"] = stopped
    return {"out": out, "environment": saved.get("environment"), "checkpoints": saved.get("checkpoints") or {}}


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def child_main(name: str, budget_s: float, result_file: str, measure: Callable[[Phase], None],
               extra: Callable[[], dict[str, Any]]) -> None:
    """The phase's process: measure under ``budget_s``, saving ``{out, **extra()}`` to ``result_file`` (atomically)
    after every step; SIGTERM records where it stopped and unwinds (see the module)."""
    path = Path(result_file)

    def save(out: dict[str, Any]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"out": out, **extra()}, default=str))
        os.replace(tmp, path)

    phase = Phase(name, budget_s, save)

    def on_term(signum: int, frame: Any) -> None:
        phase.out["status"] = f"stopped before {phase.out.get('reached') or 'its first step'}: at its " \
                              f"{budget_s:.0f} s hard limit"
        phase.save()
        raise PhaseOverrun(phase.out["status"])

    signal.signal(signal.SIGTERM, on_term)
    print(f"\n=== {name} (budget {budget_s:.0f} s, pid {os.getpid()})", flush=True)
    try:
        measure(phase)
        phase.out["status"] = "ok"
    except PhaseOverrun as exc:
        phase.out["status"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - recorded: the run goes on with its next phase
        phase.out["status"] = f"failed: {type(exc).__name__}: {exc}"
        phase.out["traceback"] = traceback.format_exc(limit=12)
        traceback.print_exc()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here on a second stop just ends the process
        phase.out["measured_s"] = round(time.perf_counter() - phase.started, 1)
        phase.save()
    print(f"=== {name}: {phase.out['status']} after {phase.out['measured_s']} s", flush=True)
