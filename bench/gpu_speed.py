"""The GPU benchmark's ``speed`` phases (:mod:`kvbaton.bench.gpu`), one per shape: decode ms/token at batch 1
against transformers decoding with its own cache and the weights-read floor; tokens/s of concurrent requests
forked from one handle; TTFT of text replay vs resume from a handle and transformers' forward (prefill
tokens/s); a profile of batch-1 decode steps; greedy agreement in the speed dtype with transformers and with
kvbaton's eager runner. Every number is the spread of repeated measurements (:mod:`.spread`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from kvbaton.bench.common import parallel
from kvbaton.bench.gpu_harness import (
    Bench,
    Phase,
    Plan,
    agreement,
    describe_runner,
    env_var,
    greedy_params,
    hf_decode_s,
    hf_greedy,
    hf_prefill_s,
    random_tokens,
)
from kvbaton.bench.spread import cell, measured


def speed_phase(bench: Bench, phase: Phase, shape: str) -> None:
    """Decode, concurrent decode, TTFT and prefill against transformers on one shape (see the module)."""
    from kvbaton.backend import Engine, load_model

    plan, device, dtype = bench.plan, bench.device, bench.plan.speed_dtype
    ckpt = bench.checkpoint(shape, dtype)
    engine = Engine(str(ckpt), dtype=dtype, device=device, kv_budget=plan.kv_budget, prefix_cache=False)
    hf = load_model(str(ckpt), dtype=dtype, device=device, attn_implementation="sdpa").model
    vocab = engine.loaded.vocab_size
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    phase.out.update(shape=shape, dtype=dtype, weight_bytes=weight_bytes, runner=describe_runner(engine))
    rows: list[dict[str, Any]] = []
    phase.out["rows"] = rows
    bandwidth = bench.payload["phases"].get("device", {}).get("copy_bandwidth_bytes_per_s")
    if bandwidth:
        phase.out["weights_read_floor_ms"] = weight_bytes / bandwidth * 1000
    release = lambda result: engine.release(result.handle)
    warm = engine.complete(random_tokens(300, vocab, seed=1), greedy_params(4))  # kernels compiled, allocator warm
    release(warm)

    def add(metric: str, ours: list[float], theirs: list[float] | None, unit: str) -> dict[str, Any]:
        row: dict[str, Any] = {"shape": shape, "dtype": dtype, "metric": metric, "unit": unit}
        measured(row, "kvbaton", ours)
        if theirs:
            measured(row, "transformers", theirs)
            higher = unit.endswith("/s")
            row["ratio"] = row["kvbaton"] / row["transformers"] if higher else row["transformers"] / row["kvbaton"]
        rows.append(row)
        bench.payload["rows"].append(row)
        print(f"  {metric}: kvbaton {cell(row, 'kvbaton')} {unit}"
              + (f", transformers {cell(row, 'transformers')} ({row['ratio']:.2f}x)" if theirs else ""), flush=True)
        return row

    # decode at batch 1
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
    for k in plan.concurrency:
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
        if shape != "8b" or k <= 64:  # transformers' own cache of 128 x 2K tokens of the 8B shape: 32 GB, skipped
            context = random_tokens(plan.shared_context, vocab, seed=4)
            theirs = [k / hf_decode_s(hf, context, k, max(4, plan.hf_steps // 2), device)]
        add(f"decode tokens/s, {k} concurrent requests from a {plan.shared_context}-token handle", ours, theirs, "tok/s")
    engine.release(shared)
    # TTFT: replay vs resume, and transformers' forward (prefill)
    question = random_tokens(16, vocab, seed=5)
    big = None
    for n in plan.ttft_lengths:
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
        add(f"prefill tokens/s at {n} tokens", [(n + 16) / r.timings.ttft_s for r in replay],
            [(n + 16) / s for s in forward], "tok/s")
        if n > plan.big_chunk // 2:
            if big is None:
                big = Engine(str(ckpt), dtype=dtype, device=device, kv_budget=plan.kv_budget, prefix_cache=False,
                             max_batch_tokens=plan.big_chunk)
            one = [big.complete(context + question, greedy_params(1)) for _ in range(plan.repeats)]
            for r in one:
                big.release(r.handle)
            add(f"prefill tokens/s at {n} tokens, chunks of {plan.big_chunk}", [(n + 16) / r.timings.ttft_s for r in one],
                [(n + 16) / s for s in forward], "tok/s")
    if big is not None:
        big.close()
    phase.check("the decode profile")
    try:
        phase.out["profile"] = decode_profile(engine, vocab, plan, device)
    except Exception as exc:  # noqa: BLE001 - the profiler is a diagnosis: its failure loses no measurement
        phase.out["profile_error"] = f"{type(exc).__name__}: {exc}"
    phase.check("greedy agreement")
    phase.out["agreement"] = bf16_agreement(engine, hf, ckpt, vocab, plan, device) if dtype != "float32" else None
    phase.out["runner"] = describe_runner(engine)
    engine.close()


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


def bf16_agreement(engine: Any, hf: Any, ckpt: Path, vocab: int, plan: Plan, device: str) -> dict[str, Any]:
    """Greedy agreement of kvbaton (this runner) with transformers and with kvbaton's eager runner, same dtype."""
    from kvbaton.backend import Engine

    prompts = [random_tokens(200, vocab, seed=300 + i) for i in range(6)]
    steps = plan.exact_steps

    def greedy(eng: Any) -> list[list[int]]:
        out = []
        for p in prompts:
            result = eng.complete(p, greedy_params(steps))
            eng.release(result.handle)
            out.append(result.token_ids)
        return out

    ours = greedy(engine)
    with env_var("KVBATON_CUDA_RUNNER", "0"):
        eager_engine = Engine(str(ckpt), dtype=plan.speed_dtype, device=device, kv_budget="2GiB", prefix_cache=False)
    eager = greedy(eager_engine)
    eager_engine.close()
    reference = [hf_greedy(hf, p, steps, device) for p in prompts]
    return {"vs_transformers": agreement(ours, reference), "eager_runner_vs_transformers": agreement(eager, reference),
            "vs_eager_runner": agreement(ours, eager), "prompts": len(prompts), "steps": steps}
