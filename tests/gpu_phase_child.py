"""A stand-in for one phase of the GPU benchmark, run by tests/test_bench_gpu.py through ``gpu_process.run_phase``
(no torch, no model: starts in a fraction of a second): it writes one row, reaches a step, then takes longer than
any budget. ``--mode polite`` lets SIGTERM stop it (the phase's handler); ``--mode stubborn`` ignores SIGTERM, so
only the SIGKILL after the grace period ends it."""

from __future__ import annotations

import argparse
import signal
import time

from kvbaton.bench.gpu_process import Phase, child_main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["polite", "stubborn"], required=True)
    parser.add_argument("--phase-child", required=True)
    parser.add_argument("--child-out", required=True)
    parser.add_argument("--child-budget", type=float, required=True)
    args = parser.parse_args()

    def measure(phase: Phase) -> None:
        phase.add({"shape": "x", "metric": "first row", "kvbaton": 1.0})
        phase.check("the long step")
        if args.mode == "stubborn":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _ in range(600):  # far past any budget the test gives
            time.sleep(0.1)

    child_main(args.phase_child, args.child_budget, args.child_out, measure, lambda: {"environment": {"x": 1}})


if __name__ == "__main__":
    main()
