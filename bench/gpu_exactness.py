"""The GPU benchmark's ``exactness`` phase (:mod:`kvbaton.bench.gpu`): on the peaked fp32 checkpoint, the greedy
tokens of dense prefill, resume from a handle (its question as rows of the decode step), forks decoded
concurrently, chunked prefill, prefix-cache hits, a prefix loaded back from the host tier and a batch of
concurrent requests, each against transformers' ``generate``; decode replayed from CUDA graphs against the same
step run eagerly. Each check records whether it is token-identical and where it first differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvbaton.bench.common import parallel
from kvbaton.bench.gpu_harness import (
    Bench,
    Phase,
    describe_runner,
    first_difference,
    greedy_params,
    hf_greedy,
    random_tokens,
)


def host_tier_check(bench: Bench, ckpt: Any, vocab: int, check: Callable[..., None]) -> None:
    """A prompt's blocks evicted to the host tier by two others (the device pool holds one prompt), then the
    prompt again: its prefix comes back from the tier (the slab, the batched copies), and its tokens must be
    the reference's."""
    from kvbaton.backend import Engine, load_model

    device, steps = bench.device, bench.plan.exact_steps
    n = max(64, max(bench.plan.exact_lengths) // 4)  # whole blocks to evict
    engine = Engine(str(ckpt), dtype="float32", device=device, kv_budget=f"{-(-(n + steps) // 16) + 4} blocks",
                    tiers=["host:64MiB"], prefetch=False)
    try:
        prompts = [random_tokens(n, vocab, seed=600 + i) for i in range(3)]
        for prompt in prompts:
            engine.release(engine.complete(prompt, greedy_params(2)).handle)
        again = prompts[0] + random_tokens(4, vocab, seed=610)
        result = engine.complete(again, greedy_params(steps))
        loaded = engine.kv.counters.hits.get("host", 0)
        hf = load_model(str(ckpt), dtype="float32", device=device, attn_implementation="sdpa").model
        check(f"prefix loaded back from the host tier ({loaded} blocks, {result.timings.tokens_reused} tokens reused)",
              again, result.token_ids, hf_greedy(hf, again, steps, device))
        engine.release(result.handle)
    finally:
        engine.close()


def exactness_phase(bench: Bench, phase: Phase) -> None:
    """fp32 greedy tokens of every path against transformers (see the module)."""
    from kvbaton.backend import Engine, load_model
    from kvbaton.backend.compute.cuda.runner import CudaGraphRunner

    plan, device = bench.plan, bench.device
    ckpt = bench.checkpoint(plan.exact_shape, "float32", peaked=True)
    engine = Engine(str(ckpt), dtype="float32", device=device, kv_budget=plan.kv_budget)
    chunked = Engine(str(ckpt), dtype="float32", device=device, kv_budget=plan.kv_budget, prefix_cache=False,
                     prefill_chunk=64, max_batch_tokens=64)
    hf = load_model(str(ckpt), dtype="float32", device=device, attn_implementation="sdpa").model
    vocab = engine.loaded.vocab_size
    steps = plan.exact_steps
    checks: list[dict[str, Any]] = []
    phase.out["checks"] = checks
    phase.out["runner"] = describe_runner(engine)

    def check(name: str, prompt: Sequence[int], ours: Sequence[int], reference: Sequence[int]) -> None:
        checks.append({"check": name, "prompt_tokens": len(prompt), "tokens": len(reference),
                       "identical": list(ours) == list(reference), "first_difference": first_difference(ours, reference)})

    def run(eng: Any, fn: Callable[[], Any]) -> list[int]:
        result = fn()
        eng.release(result.handle)
        return result.token_ids

    prompts = {n: random_tokens(n, vocab, seed=n) for n in plan.exact_lengths}
    refs = {n: hf_greedy(hf, p, steps, device) for n, p in prompts.items()}
    for n, prompt in prompts.items():
        phase.check(f"the {n}-token prompt")
        check("dense prefill", prompt, run(engine, lambda p=prompt: engine.complete(p, greedy_params(steps))), refs[n])
        if n > 8:
            handle = engine.materialize(prompt[:-8])
            check("resume from a handle", prompt,
                  run(engine, lambda h=handle, p=prompt: engine.resume(h, p[-8:], greedy_params(steps))), refs[n])
            engine.release(handle)
        if n >= 64:
            check("chunked prefill (64-token chunks)", prompt,
                  run(chunked, lambda p=prompt: chunked.complete(p, greedy_params(steps))), refs[n])
    longest = prompts[max(prompts)]
    phase.check("forks")
    suffixes = [random_tokens(8, vocab, seed=90 + i) for i in range(3)]
    base = engine.materialize(longest)
    forks = engine.fork(base, len(suffixes))
    results = parallel([lambda f=f, s=s: engine.resume(f, s, greedy_params(steps)) for f, s in zip(forks, suffixes)])
    for result, suffix in zip(results, suffixes):
        check("fork, decoded concurrently", longest + suffix, result.token_ids, hf_greedy(hf, longest + suffix, steps, device))
        engine.release(result.handle)
    engine.release([base, *forks])
    phase.check("prefix-cache hits")
    shared = random_tokens(max(plan.exact_lengths) // 2 + 40, vocab, seed=7)
    for i in range(2):
        prompt = shared + random_tokens(12, vocab, seed=70 + i)
        result = engine.complete(prompt, greedy_params(steps))
        check(f"prefix-cache {'hit' if result.timings.tokens_reused else 'miss'} "
              f"({result.timings.tokens_reused} tokens reused)", prompt, result.token_ids,
              hf_greedy(hf, prompt, steps, device))
        engine.release(result.handle)
    phase.check("a prefix loaded back from the host tier")
    host_tier_check(bench, ckpt, vocab, check)
    phase.check("concurrent requests")
    batch = [random_tokens(10 + 37 * i, vocab, seed=200 + i) for i in range(8)]
    results = parallel([lambda p=p: engine.complete(p, greedy_params(steps)) for p in batch])
    for prompt, result in zip(batch, results):
        check("one of 8 concurrent requests", prompt, result.token_ids, hf_greedy(hf, prompt, steps, device))
        engine.release(result.handle)
    if isinstance(engine.runner, CudaGraphRunner):
        phase.check("graphs against eager")
        graphed = [run(engine, lambda p=p: engine.complete(p, greedy_params(steps))) for p in batch[:3]]
        engine.runner.use_graphs = False
        try:
            eager = [run(engine, lambda p=p: engine.complete(p, greedy_params(steps))) for p in batch[:3]]
        finally:
            engine.runner.use_graphs = True
        for prompt, g, e in zip(batch, graphed, eager):
            check("decode from CUDA graphs vs the same step eagerly", prompt, g, e)
    phase.out["runner"] = describe_runner(engine)
    phase.out["passed"] = sum(c["identical"] for c in checks)
    phase.out["total"] = len(checks)
    engine.close()
    chunked.close()
