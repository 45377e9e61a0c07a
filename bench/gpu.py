"""kvbaton's engine on one GPU against plain transformers on the same GPU, in one command (issues 38 and 50), run
in parts that each fit a few minutes of a lent GPU: ``python -m kvbaton.bench gpu [--phases ...]``.

No model file is carried to a GPU machine: random-weight Llama checkpoints are built on the device, each with
the default model's tokenizer files beside them (``--tokenizer``): the SmolLM2-135M shape in fp32 with the final
norm scaled so that logits are peaked (greedy choices are then not decided by rounding: the exactness checks),
and the Llama-3.2-1B and Llama-3-8B shapes in bf16 (speed, workflow). Then phase by phase, each in a process of
its own under a hard time limit (:mod:`.gpu_process`: stopped at its budget, keeping every row it measured; the
record is rewritten after every phase, so a run killed from outside leaves what it measured):

1. ``device``: the GPU's two ceilings (a large device-to-device copy, a large bf16 matrix product), the CUDA
   runner's kernels against the torch reference on random data (fp32 and bf16) with their times, and each
   local prefill attention kind (SDPA's cuDNN and FlashAttention backends...) on a fresh 4K/16K/32K prompt.
2. ``exactness`` (135M shape, fp32): greedy tokens of dense prefill, resume from a handle (its question as rows
   of the decode step), forks decoded concurrently, chunked prefill, prefix-cache hits and a batch of
   concurrent requests, each against transformers' ``generate``; decode replayed from CUDA graphs against the
   same step run eagerly.
3. ``speed-1b``, ``speed-8b`` (bf16, :mod:`.gpu_speed`): decode ms/token at batch 1 against transformers and the
   weights-read floor; tokens/s of concurrent requests forked from one 2K-token handle; TTFT of text replay vs
   resume from a handle (the resume's fixed cost) and transformers' forward, prefill tokens/s at 4K/16K/32K
   against transformers and as a share of the GPU's measured matrix-product ceiling; a profile of batch-1
   decode steps; the bf16 logit error against an fp32 reference of the same weights, next to transformers'
   (:mod:`.gpu_logits`).
4. ``workflow``: ``bench workflow`` on the device with the host tier, on the shape ``--workflow-shape`` names
   (default: the 8B shape, 6-8K-token fixed prompts), whose checkpoint it builds when no earlier phase did.

``--device cpu --quick`` runs the same code with tiny shapes on CPU in about a minute (a smoke test: its record
says ``quick`` and is never published). With ``--device cuda`` and no CUDA device it prints ``skipped: no CUDA
device`` and exits 0. Nothing is estimated: every number in the record was measured in this run, on the machine
the record names (``machine.gpu``). ``scripts/gpu_run.sh`` runs this on a lent GPU machine, one part per call
(docs/development.md, "The GPU run").

This module runs the phases and renders the record; the harness (plan, phases, checkpoints) is
:mod:`.gpu_harness`, the processes :mod:`.gpu_process`, the phases :mod:`.gpu_device`, :mod:`.gpu_exactness`,
:mod:`.gpu_speed` and the workflow phase here.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
from kvbaton.bench import record
from kvbaton.bench.common import format_table
from kvbaton.bench.gpu_harness import (
    FULL,
    QUICK,
    TOKENIZER_ENV,
    TOKENIZER_FILES,
    WORKFLOW_SIZES,
    Bench,
    Phase,
    checkpoint_root,
    environment,
)
from kvbaton.bench.gpu_process import child_main, run_phase
from kvbaton.bench.spread import cell

QUICK_ARGS = ["--quick"]


# -- the workflow phase -----------------------------------------------------------------------------------------------


def workflow_phase(bench: Bench, phase: Phase, shape: str) -> None:
    """``bench workflow`` on the device with the host tier (a disk tier on CPU), on ``shape``: its checkpoint is
    built here when no earlier phase built it, never swapped for a smaller shape's."""
    from kvbaton.bench import workflow

    tier = "host" if bench.cuda() else "disk"
    low, high, rounds = WORKFLOW_SIZES[shape]
    phase.out.update(shape=shape, fixed_min=low, fixed_max=high, rounds=rounds, tier=tier)
    phase.check(f"the {shape} checkpoint")
    ckpt = bench.checkpoint(shape, bench.plan.speed_dtype)
    phase.check("the workflow")
    payload = workflow.run(rounds=rounds, fixed_min=low, fixed_max=high, device=bench.device, model=str(ckpt),
                           dtype=bench.plan.speed_dtype, slow_tier=tier, bounded=False,
                           max_tokens=2 if bench.quick else 16, suffix_tokens=8 if bench.quick else 32)
    phase.out["result"] = {k: v for k, v in payload.items() if k != "rows"}
    phase.out["result"]["rows"] = [{k: v for k, v in row.items() if k not in ("call_log", "rounds")}
                                   for row in payload["rows"]]


# -- the table ----------------------------------------------------------------------------------------------------


def table(payload: dict[str, Any]) -> str:
    columns = ["shape", "metric", "kvbaton", "transformers", "kvbaton advantage", "resume s", "replay / resume"]
    ceiling = any("ceiling_share" in r for r in payload.get("rows", []))  # records since issue 50
    if ceiling:
        columns.append("share of the matmul ceiling (kvbaton / transformers)")
    rows = []
    for r in payload.get("rows", []):
        rows.append([f"{r['shape']} {r['dtype']}", r["metric"], cell(r, "kvbaton", 4),
                     cell(r, "transformers", 4) if "transformers" in r else "-",
                     f"{r['ratio']:.2f}x" if "ratio" in r else "-",
                     cell(r, "resume", 4) if "resume" in r else "", f"{r['replay_over_resume']:.1f}x"
                     if "replay_over_resume" in r else ""])
        if ceiling:
            rows[-1].append(f"{r['ceiling_share']:.0%} / {r['transformers_ceiling_share']:.0%}"
                            if "ceiling_share" in r else "")
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
    out += _local_attention(device.get("local_attention") or [])
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
        if p.get("bf16_matmul_flop_per_s"):
            out.append(f"{p.get('shape')}: measured in the phase's process: bf16 matrix product "
                       f"{p['bf16_matmul_flop_per_s'] / 1e12:.0f} TFLOP/s (the prefill rows' ceiling), "
                       f"device-to-device copy {p['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; the engine's step "
                       f"budget {p.get('max_batch_tokens')} tokens ({(p.get('runner') or {}).get('ops')})")
        out += _logit_error(p)
        agree = p.get("agreement")
        if agree:
            out.append(f"{p.get('shape')} bf16 greedy agreement: with transformers {agree['vs_transformers']:.1%}, "
                       f"with kvbaton's eager runner {agree['vs_eager_runner']:.1%} (eager runner with transformers "
                       f"{agree['eager_runner_vs_transformers']:.1%})")
    out += [f"  {name}: {p['traceback'].strip().splitlines()[-1]}" for name, p in phases.items() if p.get("traceback")]
    flow = (phases.get("workflow") or {}).get("result")
    if flow:
        steady = flow.get("steady_state_ratios") or {}
        out.append(f"workflow on {phases['workflow'].get('shape')} ({flow.get('slow_tier')}): steady state "
                   + ", ".join(f"{k} {v:.2f}x" for k, v in steady.items() if isinstance(v, float)))
    return out


def _local_attention(entries: list[dict[str, Any]]) -> list[str]:
    """One line per prompt length and head shape: each local prefill attention kind's time."""
    out, groups = [], {}
    for e in entries:
        groups.setdefault((e["tokens"], tuple(e["heads"])), []).append(e)
    for (tokens, heads), kinds in groups.items():
        parts = [f"{e['kind']} {e['ms']:.2f} ms ({e['tflops']:.0f} TFLOP/s)" if "ms" in e else
                 f"{e['kind']} unavailable" for e in kinds]
        out.append(f"local prefill attention, bf16, {tokens} tokens, heads {list(heads)}: " + ", ".join(parts))
    return out


def _logit_error(p: dict[str, Any]) -> list[str]:
    """The bf16 logit error line of a speed phase (kvbaton's prefill and decode rows, transformers)."""
    e = p.get("logit_error")
    if not e:
        return []

    def one(m: dict[str, float]) -> str:
        return (f"max {m['max_abs']:.3g} / mean {m['mean_abs']:.2g} abs, KL mean {m['kl_mean']:.1e} (max "
                f"{m['kl_max']:.1e}), top-1 {m['top1_agreement']:.1%}")

    return [(f"{p.get('shape')} {p.get('dtype')} logits against an fp32 reference of the same weights "
             f"({e['prompts']} prompts x {e['tokens']} tokens): kvbaton prefill {one(e['kvbaton_prefill'])}; "
             f"kvbaton decode rows (last {e['decode_rows']} tokens) {one(e['kvbaton_decode_rows'])}; "
             f"transformers {one(e['transformers'])}")]


# -- main -------------------------------------------------------------------------------------------------------


def _measures(bench: Bench, args: argparse.Namespace) -> dict[str, Callable[[Phase], None]]:
    from kvbaton.bench.gpu_device import device_phase
    from kvbaton.bench.gpu_exactness import exactness_phase
    from kvbaton.bench.gpu_speed import speed_phase

    measures: dict[str, Callable[[Phase], None]] = {
        "device": lambda p: device_phase(bench, p), "exactness": lambda p: exactness_phase(bench, p)}
    for name, sp in bench.plan.speed:
        measures[name] = lambda p, sp=sp: speed_phase(bench, p, sp)
    measures["workflow"] = lambda p: workflow_phase(bench, p, args.workflow_shape)
    return measures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default; skipped without one), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and sizes (a smoke run, about a minute on CPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole run's time (default: the chosen phases' budgets); each phase gets its share, "
                             "scaled down when less, and is stopped when it is spent")
    parser.add_argument("--phases", nargs="+", default=None, help="run only these phases (default: all)")
    parser.add_argument("--workflow-shape", default=None, choices=sorted(WORKFLOW_SIZES),
                        help="the workflow phase's shape (default: 8b; tiny with --quick)")
    parser.add_argument("--tokenizer", default=None,
                        help=f"folder with the default model's {', '.join(TOKENIZER_FILES)} (default: ${TOKENIZER_ENV}, "
                             ".gpu/tokenizer, else the converted default model)")
    parser.add_argument("--checkpoints", default=None,
                        help="keep the built checkpoints in this folder and reuse the complete ones found there "
                             "(default: a fresh folder, deleted at the end)")
    parser.add_argument("--workdir", default=None, help="where a fresh checkpoint folder goes (default /dev/shm or "
                                                        "the temp dir)")
    parser.add_argument("--phase-child", default=None, help=argparse.SUPPRESS)  # one phase, in its own process
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-budget", type=float, default=0.0, help=argparse.SUPPRESS)
    record.add_arguments(parser, "gpu")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    args.workflow_shape = args.workflow_shape or plan.workflow
    if args.phase_child:
        bench = Bench(args, plan)
        env = environment(args.device)
        child_main(args.phase_child, args.child_budget, args.child_out, _measures(bench, args)[args.phase_child],
                   lambda: {"environment": env, "checkpoints": bench.built})
        return
    unknown = sorted(set(args.phases or ()) - set(plan.budgets))
    if unknown:
        parser.error(f"unknown phase(s) {', '.join(unknown)}: the phases are {', '.join(plan.budgets)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    chosen = [name for name in plan.budgets if args.phases is None or name in args.phases]
    planned = sum(plan.budgets[name] for name in chosen)
    budget_s = planned if args.budget_s is None else args.budget_s
    scale = min(1.0, budget_s / planned)  # a shorter run: every chosen phase gets its share
    root, owned = checkpoint_root(args.checkpoints, args.workdir)
    child_args = ["--device", args.device, "--checkpoints", str(root), "--workflow-shape", args.workflow_shape]
    child_args += (["--quick"] if args.quick else []) + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
    payload: dict[str, Any] = {"benchmark": "gpu", "device": args.device, "quick": args.quick,
                               "plan": dataclasses.asdict(plan), "workflow_shape": args.workflow_shape,
                               "environment": environment("cpu"), "phases": {}, "rows": [], "checkpoints": {}}
    dtypes = sorted({"float32", plan.speed_dtype})
    with record.Recording("gpu", args.results_dir, args.run_id, argv, quick=args.quick or args.quick_record) as rec:
        write = lambda partial: rec.write(payload, dtypes=dtypes, partial=partial,
                                          machine=payload["environment"].get("machine"))
        try:
            deadline = time.perf_counter() + budget_s
            for name in chosen:
                budget = min(plan.budgets[name] * scale, deadline - time.perf_counter())
                if budget < 5:
                    payload["phases"][name] = {"status": "not started: the run's time is spent", "budget_s": 0}
                    continue
                result = run_phase(name, budget, child_args)
                payload["phases"][name] = result["out"]
                payload["rows"] += result["out"].get("rows", [])
                if result["environment"] and not payload["environment"].get("machine"):
                    payload["environment"] = result["environment"]
                payload["checkpoints"].update(result["checkpoints"])
                print(f"=== {name}: {result['out']['status']} ({result['out']['seconds']} s of "
                      f"{result['out']['budget_s']})", flush=True)
                write(True)
            path = write(False)
        finally:
            if owned:
                shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(payload))
    print("\n".join(notes(payload)))
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
