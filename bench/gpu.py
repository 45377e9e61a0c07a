"""kvbaton's engine on one GPU against plain transformers on the same GPU, in one command (issue 38), built to
finish within eight minutes on one H200: ``python -m kvbaton.bench gpu``.

No model file is carried to a GPU machine: random-weight Llama checkpoints are built on the device, each with
the default model's tokenizer files beside it (``--tokenizer``): the SmolLM2-135M shape in fp32 with the final
norm scaled so that logits are peaked (greedy choices are then not decided by rounding: the exactness checks),
and the Llama-3.2-1B and Llama-3-8B shapes in bf16 (speed). Then phase by phase, each with its own time budget
(a phase over its budget stops at its next measurement and keeps what it got; the record is rewritten after
every phase, so a run killed from outside leaves what it measured):

1. ``device``: the GPU's two ceilings (a large device-to-device copy, a large bf16 matrix product) and the CUDA
   runner's kernels against the torch reference on random data (fp32 and bf16), with their times.
2. ``exactness`` (135M shape, fp32): greedy tokens of dense prefill, resume from a handle, forks decoded
   concurrently, chunked prefill, prefix-cache hits and a batch of concurrent requests, each against
   transformers' ``generate``; decode replayed from CUDA graphs against the same step run eagerly.
3. ``speed-1b``, ``speed-8b`` (bf16): decode ms/token at batch 1 (512 tokens of context) against transformers
   decoding with its own cache, and the weights-read floor (weights / measured copy bandwidth); tokens/s of
   8/32/64/128 concurrent requests forked from one 2K-token handle, against transformers decoding the same
   batch; TTFT of text replay vs resume from a handle at 1K/4K/16K/32K tokens and a transformers forward over
   the same tokens (prefill tokens/s); a profile of batch-1 decode steps (kernels and GPU time per step); greedy
   agreement in bf16 with transformers and with kvbaton's eager runner (``KVBATON_CUDA_RUNNER=0``).
4. ``workflow``: ``bench workflow`` on the device with the host tier, on the largest shape the time left allows
   (8K-token fixed prompts on the 8B shape, else 2-4K on the 1B shape).

``--device cpu --quick`` runs the same code with tiny shapes on CPU in about a minute (a smoke test: its record
says ``quick`` and is never published). With ``--device cuda`` and no CUDA device it prints ``skipped: no CUDA
device`` and exits 0. Nothing is estimated: every number in the record was measured in this run, on the machine
the record names (``machine.gpu``). ``scripts/gpu_run.sh`` runs this on a lent GPU machine (docs/development.md).

This module runs the phases and renders the record; the harness (plan, phases' budgets, checkpoints) is
:mod:`.gpu_harness`, the phases :mod:`.gpu_device`, :mod:`.gpu_exactness`, :mod:`.gpu_speed` and the workflow
phase here.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from kvbaton.bench import record
from kvbaton.bench.common import format_table
from kvbaton.bench.gpu_device import device_phase
from kvbaton.bench.gpu_exactness import exactness_phase
from kvbaton.bench.gpu_harness import FULL, QUICK, TOKENIZER_ENV, TOKENIZER_FILES, Bench, Phase, PhaseOverrun
from kvbaton.bench.gpu_speed import speed_phase
from kvbaton.bench.spread import cell

QUICK_ARGS = ["--quick"]


# -- the workflow phase -----------------------------------------------------------------------------------------------


def workflow_phase(bench: Bench, phase: Phase) -> None:
    """``bench workflow`` on the device with the host tier, on the largest shape whose checkpoint exists (or is
    cheap) and whose run fits the time left."""
    from kvbaton.bench import workflow

    tier = "host" if bench.cuda() else "disk"
    for shape, low, high, rounds in bench.plan.workflow:
        key = f"{shape}-{bench.plan.speed_dtype}"
        if key not in bench.checkpoints and shape != bench.plan.workflow[-1][0]:
            continue  # that shape's speed phase did not build it (out of time): the next shape
        if shape == "8b" and phase.left() < 100:
            continue
        ckpt = bench.checkpoint(shape, bench.plan.speed_dtype)
        phase.out.update(shape=shape, fixed_min=low, fixed_max=high, rounds=rounds, tier=tier)
        payload = workflow.run(rounds=rounds, fixed_min=low, fixed_max=high, device=bench.device, model=str(ckpt),
                               dtype=bench.plan.speed_dtype, slow_tier=tier, bounded=False,
                               max_tokens=2 if bench.quick else 16, suffix_tokens=8 if bench.quick else 32)
        phase.out["result"] = {k: v for k, v in payload.items() if k != "rows"}
        phase.out["result"]["rows"] = [{k: v for k, v in row.items() if k not in ("call_log", "rounds")}
                                       for row in payload["rows"]]
        return
    raise PhaseOverrun("no shape fits the time left")


# -- the table ----------------------------------------------------------------------------------------------------


def table(payload: dict[str, Any]) -> str:
    columns = ["shape", "metric", "kvbaton", "transformers", "kvbaton advantage", "resume s", "replay / resume"]
    rows = []
    for r in payload.get("rows", []):
        rows.append([f"{r['shape']} {r['dtype']}", r["metric"], cell(r, "kvbaton", 4),
                     cell(r, "transformers", 4) if "transformers" in r else "-",
                     f"{r['ratio']:.2f}x" if "ratio" in r else "-",
                     cell(r, "resume", 4) if "resume" in r else "", f"{r['replay_over_resume']:.1f}x"
                     if "replay_over_resume" in r else ""])
    return format_table(columns, rows) if rows else "(no speed rows: see the phases' status)"


def notes(payload: dict[str, Any]) -> list[str]:
    """The lines under the table: machine, phases, exactness, kernels, profile, agreement, workflow."""
    env = payload.get("environment") or {}
    machine = env.get("machine") or {}
    out = [(f"GPU {machine.get('gpu', '-')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
            f"Triton {env.get('triton')}, transformers {env.get('transformers')}")]
    phases = payload.get("phases") or {}
    out.append("phases: " + "; ".join(f"{name} {p.get('status')} ({p.get('seconds', '-')} s of {p.get('budget_s')})"
                                       for name, p in phases.items()))
    device = phases.get("device") or {}
    if device.get("copy_bandwidth_bytes_per_s"):
        out.append(f"ceilings: device-to-device copy {device['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, "
                   f"bf16 matrix product {device['bf16_matmul_flop_per_s'] / 1e12:.0f} TFLOP/s")
    for k in device.get("kernels") or []:
        if k.get("error") is not None:
            out.append(f"kernel {k['kernel']} {k['dtype']} heads {k['heads']}: relative error {k['error']:.1e}, "
                       f"{k['ms']:.3f} ms")
        else:
            out.append(f"kernel {k['kernel']} {k['dtype']}: {k.get('failed')}")
    exact = phases.get("exactness") or {}
    if exact.get("total"):
        out.append(f"fp32 exactness: {exact['passed']} of {exact['total']} greedy checks token-identical "
                   f"({exact.get('runner')})")
        out += [f"  not identical: {c['check']} ({c['prompt_tokens']} tokens), first difference at token "
                f"{c['first_difference']}" for c in exact.get("checks", []) if not c["identical"]]
    for name, p in phases.items():
        if not name.startswith("speed"):
            continue
        if p.get("weights_read_floor_ms"):
            out.append(f"{p.get('shape')}: weights-read floor {p['weights_read_floor_ms']:.2f} ms per decode step "
                       f"({p['weight_bytes'] / 1e9:.2f} GB of weights at the measured copy bandwidth)")
        prof = p.get("profile")
        if prof:
            out.append(f"{p.get('shape')} batch-1 decode profile: {prof['kernels_per_step']:.0f} kernels and "
                       f"{prof['gpu_kernel_ms_per_step']:.2f} ms of GPU kernel time per step against "
                       f"{prof['wall_ms_per_step']:.2f} ms of wall time; launches {prof['launches']}")
        agree = p.get("agreement")
        if agree:
            out.append(f"{p.get('shape')} bf16 greedy agreement: with transformers {agree['vs_transformers']:.1%}, "
                       f"with kvbaton's eager runner {agree['vs_eager_runner']:.1%} (eager runner with transformers "
                       f"{agree['eager_runner_vs_transformers']:.1%})")
    flow = (phases.get("workflow") or {}).get("result")
    if flow:
        steady = flow.get("steady_state_ratios") or {}
        out.append(f"workflow on {phases['workflow'].get('shape')} ({flow.get('slow_tier')}): steady state "
                   + ", ".join(f"{k} {v:.2f}x" for k, v in steady.items() if isinstance(v, float)))
    return out


# -- main -------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default; skipped without one), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and sizes (a smoke run, about a minute on CPU)")
    parser.add_argument("--budget-s", type=float, default=460,
                        help="the whole run's time (default 460); each phase has its share, scaled down when less")
    parser.add_argument("--phases", nargs="+", default=None, help="run only these phases (default: all)")
    parser.add_argument("--tokenizer", default=None,
                        help=f"folder with the default model's {', '.join(TOKENIZER_FILES)} (default: ${TOKENIZER_ENV}, "
                             ".gpu/tokenizer, else the converted default model)")
    parser.add_argument("--workdir", default=None, help="where checkpoints are built (default /dev/shm or the temp dir)")
    record.add_arguments(parser, "gpu")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    plan = QUICK if args.quick else FULL
    chosen = [name for name in plan.budgets if args.phases is None or name in args.phases]
    scale = args.budget_s / sum(plan.budgets[name] for name in chosen)
    if scale < 1:  # a shorter run: every chosen phase gets its share
        plan = dataclasses.replace(plan, budgets={k: v * scale for k, v in plan.budgets.items()})
    with record.Recording("gpu", args.results_dir, args.run_id, argv, quick=args.quick or args.quick_record) as rec:
        bench = Bench(args, plan, rec)
        try:
            phases: list[tuple[str, Callable[[Phase], None]]] = [
                ("device", lambda p: device_phase(bench, p)), ("exactness", lambda p: exactness_phase(bench, p))]
            phases += [(name, lambda p, shape=shape: speed_phase(bench, p, shape)) for name, shape in plan.speed_shapes]
            phases.append(("workflow", lambda p: workflow_phase(bench, p)))
            for name, measure in phases:
                if args.phases is None or name in args.phases:
                    bench.run(name, measure)
            path = bench.write(partial=False)
        finally:
            bench.close()
    print()
    print(table(bench.payload))
    print("\n".join(notes(bench.payload)))
    print(f"\nwritten: {path}")
