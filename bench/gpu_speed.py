"""The GPU benchmark's ``speed`` phases (:mod:`kvbaton.bench.gpu`), one per shape (:class:`.gpu_harness.SpeedPlan`):
decode ms/token at batch 1 against transformers decoding with its own cache and the weights-read floor; tokens/s
of concurrent requests forked from one handle; TTFT of text replay vs resume from a handle (the resume's
16-token question runs as rows of the decode step: its fixed cost) and transformers' forward, with prefill
tokens/s as a share of the GPU's measured matrix-product ceiling (the forward's FLOPs at the bf16 rate measured
in this process); a profile of batch-1 decode steps; and the bf16 logit error against an fp32 reference of the
same weights (:mod:`.gpu_logits`). Every number is the spread of repeated measurements (:mod:`.spread`).

The engine runs with the defaults a user gets on a GPU (its step budget, its local prefill attention), the KV
budget the plan names; transformers is plain transformers (SDPA, as it picks by default), loaded on its own.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from kvbaton.bench import gpu_logits
from kvbaton.bench.common import parallel
from kvbaton.bench.gpu_device import ceilings
from kvbaton.bench.gpu_harness import (
    SHAPES,
    Bench,
    Phase,
    Plan,
    SpeedPlan,
    describe_runner,
    free_memory,
    greedy_params,
    hf_decode_s,
    hf_model,
    hf_prefill_s,
    prefill_flops,
    random_tokens,
)
from kvbaton.bench.spread import cell, measured


def speed_phase(bench: Bench, phase: Phase, sp: SpeedPlan) -> None:
    """Decode, concurrent decode, TTFT and prefill against transformers on one shape, then the bf16 logit error."""
    from kvbaton.backend import Engine

    plan, device, dtype, shape = bench.plan, bench.device, bench.plan.speed_dtype, sp.shape
    phase.out.update(shape=shape, dtype=dtype)
    if bench.cuda():
        from triton.testing import do_bench

        phase.out.update(ceilings(torch.device(device), do_bench))  # this process's own: the device's now
        free_memory(device)
    phase.check("building the checkpoint")
    ckpt = bench.checkpoint(shape, dtype)
    phase.check("starting the engine")
    engine = Engine(str(ckpt), dtype=dtype, device=device, kv_budget=sp.kv_budget, prefix_cache=False)
    try:
        phase.check("loading transformers")
        hf = hf_model(ckpt, dtype, device)
        vocab = engine.loaded.vocab_size
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        phase.out.update(weight_bytes=weight_bytes, runner=describe_runner(engine),
                         max_batch_tokens=engine.config.max_batch_tokens)
        bandwidth = phase.out.get("copy_bandwidth_bytes_per_s")
        if bandwidth:
            phase.out["weights_read_floor_ms"] = weight_bytes / bandwidth * 1000
        warm = engine.complete(random_tokens(300, vocab, seed=1), greedy_params(4))  # kernels compiled, allocator warm
        engine.release(warm.handle)
        measure_speed(bench, phase, engine, hf, sp, vocab)
        phase.check("the decode profile")
        try:
            phase.out["profile"] = decode_profile(engine, vocab, plan, device)
        except Exception as exc:  # noqa: BLE001 - the profiler is a diagnosis: its failure loses no measurement
            phase.out["profile_error"] = f"{type(exc).__name__}: {exc}"
        phase.out["runner"] = describe_runner(engine)
        phase.check("the bf16 logit error")
        prompts = gpu_logits.prompts_for(bench, vocab)
        ours, about = gpu_logits.kvbaton_logits(engine, prompts, device)
        theirs = gpu_logits.transformers_logits(hf, prompts, device)
    finally:
        engine.close()
    del engine, hf
    free_memory(device)
    phase.out["logit_error"] = {**gpu_logits.compare(bench, phase, ckpt, prompts, ours, theirs), "runner": about}


def measure_speed(bench: Bench, phase: Phase, engine: Any, hf: Any, sp: SpeedPlan, vocab: int) -> None:
    plan, device, dtype, shape = bench.plan, bench.device, bench.plan.speed_dtype, sp.shape
    release = lambda result: engine.release(result.handle)

    def add(metric: str, ours: list[float], theirs: list[float] | None, unit: str) -> dict[str, Any]:
        row: dict[str, Any] = {"shape": shape, "dtype": dtype, "metric": metric, "unit": unit}
        measured(row, "kvbaton", ours)
        if theirs:
            measured(row, "transformers", theirs)
            higher = unit.endswith("/s")
            row["ratio"] = row["kvbaton"] / row["transformers"] if higher else row["transformers"] / row["kvbaton"]
        print(f"  {metric}: kvbaton {cell(row, 'kvbaton')} {unit}"
              + (f", transformers {cell(row, 'transformers')} ({row['ratio']:.2f}x)" if theirs else ""), flush=True)
        return phase.add(row)

    # decode at batch 1
    phase.check("decode at batch 1")
    context = random_tokens(plan.decode_context, vocab, seed=3)
    handle = engine.materialize(context)
    ours = []
    for _ in range(plan.repeats):
        result = engine.resume(handle, [], greedy_params(plan.decode_steps + 1))
        ours.append((result.timings.total_s - result.timings.ttft_s) / plan.decode_steps * 1000)
        release(result)
    engine.release(handle)
    theirs = [hf_decode_s(hf, context, 1, plan.hf_steps, device) * 1000 for _ in range(plan.repeats)]
    add(f"decode ms/token, batch 1, {plan.decode_context} context", ours, theirs, "ms")
    # concurrent requests forked from one handle
    shared = engine.materialize(random_tokens(plan.shared_context, vocab, seed=4))
    for k in sp.concurrency:
        phase.check(f"{k} concurrent requests")
        ours = []
        for _ in range(max(1, plan.repeats - 1)):
            forks = engine.fork(shared, k)
            params = greedy_params(plan.concurrent_tokens + 1)
            start = time.perf_counter()
            results = parallel([lambda f=f, params=params: engine.resume(f, [], params) for f in forks])
            ours.append(k * plan.concurrent_tokens / (time.perf_counter() - start))
            engine.release(forks + [r.handle for r in results])
        theirs = None
        if k <= sp.hf_concurrency:
            context = random_tokens(plan.shared_context, vocab, seed=4)
            theirs = [k / hf_decode_s(hf, context, k, max(4, plan.hf_steps // 2), device)]
            free_memory(device)  # transformers' cache of k contexts
        add(f"decode tokens/s, {k} concurrent requests from a {plan.shared_context}-token handle", ours, theirs,
            "tok/s")
    engine.release(shared)
    # TTFT: replay vs resume, and transformers' forward (prefill, against the matrix-product ceiling)
    question = random_tokens(16, vocab, seed=5)
    rate = phase.out.get("bf16_matmul_flop_per_s")
    for n in sp.ttft_lengths:
        phase.check(f"TTFT at {n} tokens")
        context = random_tokens(n, vocab, seed=n)
        replay = [engine.complete(context + question, greedy_params(1)) for _ in range(plan.repeats)]
        for r in replay:
            release(r)
        handle = engine.materialize(context)
        resume = [engine.resume(handle, question, greedy_params(1)) for _ in range(plan.repeats)]
        for r in resume:
            release(r)
        engine.release(handle)
        forward = [hf_prefill_s(hf, context + question, device) for _ in range(plan.repeats)]
        row = add(f"TTFT s, text replay of {n} + 16 tokens", [r.timings.ttft_s for r in replay], forward, "s")
        measured(row, "resume", [r.timings.ttft_s for r in resume])
        row["replay_over_resume"] = row["kvbaton"] / row["resume"]
        phase.save()
        prefill = add(f"prefill tokens/s at {n} tokens", [(n + 16) / r.timings.ttft_s for r in replay],
                      [(n + 16) / s for s in forward], "tok/s")
        if rate:  # the share of the GPU's matrix-product ceiling each reaches
            floor_s = prefill_flops(SHAPES[shape], vocab, n + 16) / rate
            prefill["ceiling_share"] = floor_s / statistics.median(r.timings.ttft_s for r in replay)
            prefill["transformers_ceiling_share"] = floor_s / statistics.median(forward)
            phase.save()


def decode_profile(engine: Any, vocab: int, plan: Plan, device: str) -> dict[str, Any] | None:
    """torch.profiler over batch-1 decode steps: kernels and GPU kernel time per step, against wall time."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    handle = engine.materialize(random_tokens(plan.decode_context, vocab, seed=6))
    steps = 32
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = engine.resume(handle, [], greedy_params(steps + 1))
    engine.release([handle, result.handle])
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = {name: sum(1 for e in prof.events() if e.name == name)
                for name in ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")}
    gpu_us = sum(e.device_time for e in kernels)
    return {"steps": steps, "kernels": len(kernels), "kernels_per_step": len(kernels) / (steps + 1),
            "gpu_kernel_ms_per_step": gpu_us / 1000 / (steps + 1), "launches": launches,
            "wall_ms_per_step": (result.timings.total_s - result.timings.ttft_s) / steps * 1000,
            "top": [{"name": e.key[:80], "calls": e.count, "device_ms": e.device_time_total / 1000}
                    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]]}
