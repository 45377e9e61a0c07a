"""Where a cold prefill's time goes: kvbaton's engine vs plain transformers (SDPA) on one prompt.

Development tool, not a published benchmark. It

1. builds a chat prompt of about ``--tokens`` tokens (the bench corpus, rendered by the chat template);
2. times cold prefills, ``--repeats`` rounds, every variant once per round in turn (alternating, so
   drift on a shared machine hits all alike): ``engine`` (the default engine: the prompt alone goes in
   chunks of ``max_batch_tokens``), ``engine-one`` (one forward for the whole prompt), ``engine-512``
   (512-token chunks, as while other requests are active), ``hf`` (transformers' ``model(ids)`` with
   SDPA, logits of the last token only), and with ``--unfused`` the same engine with kvbaton's fused
   prefill switched off (``engine-unfused``: the model's own modules and PyTorch's attention,
   ``kvbaton.backend.compute.cpu.prefill.disabled``). An engine prefill is ``flush_cache()``, ``materialize``,
   ``release``: the time to the prompt's handle, i.e. TTFT without the sampling;
3. with ``--breakdown``, splits one engine prefill (the default chunking, run on this thread) into
   linear layers, attention, pool writes, RoPE, norms, MLP activation, the attention module's and the
   decoder layer's own tensor work (views, copies, residual adds), and what is left (embedding,
   rotary cos/sin, LM head, Python);
4. with ``--torch-profile N``, prints the N heaviest torch ops of one engine prefill (self CPU time);
5. with ``--check``, compares the engine's last-token logits with transformers' (max |diff|, argmax),
   in chunks of max_batch_tokens, 512 and the whole prompt.

With ``--unfused``, the breakdown, torch profile and check are also done with the fusions off.

Prints medians (and min/max) of each variant, the load average per round, and for every run the share
of the CPUs other processes used meanwhile (from /proc/stat, steal included); with enough quiet runs,
the medians of those alone.

    .venv/bin/python scripts/profile_prefill.py --repeats 5 --breakdown --check
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

VARIANTS = ("engine", "engine-one", "engine-512", "hf")


def prompt_tokens(engine: Any, n: int) -> list[int]:
    from kvbaton.bench.corpus import document

    words = int(n / 1.3) + 50
    while True:
        messages = [
            {"role": "system", "content": "You are a careful assistant. Answer from the meeting notes only."},
            {"role": "user", "content": document(words, seed=7) + "\n\nWhich decisions were postponed, and why?"},
        ]
        tokens = engine.chat_tokens(messages)
        if len(tokens) >= n:
            return tokens
        words = int(words * 1.1) + 10


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


_TICK = os.sysconf("SC_CLK_TCK")


def _busy_ticks() -> tuple[int, int]:
    """(every CPU's busy ticks incl. steal, this process's ticks) from /proc; (0, 0) where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0, 0
    return sum(fields) - fields[3] - fields[4], int(own[11]) + int(own[12])  # minus idle, iowait; utime + stime


class Others:
    """Share of the machine's CPUs other processes (and the hypervisor: steal) used during a block."""

    def __enter__(self) -> Others:
        self.start, self.busy = time.perf_counter(), _busy_ticks()
        return self

    def __exit__(self, *exc: Any) -> None:
        busy, own = _busy_ticks()
        wall = time.perf_counter() - self.start
        self.share = max(0.0, (busy - self.busy[0] - (own - self.busy[1])) / _TICK / (wall * (os.cpu_count() or 1)))


@contextlib.contextmanager
def timers(model: Any, pool: Any, clock: Callable[[], float] = time.perf_counter) -> Iterator[dict[str, float]]:
    """Exclusive time per category while the block runs (hooks on the engine's model)."""
    import kvbaton.backend.compute.attention as attention_module
    from transformers import AttentionInterface

    totals: dict[str, float] = defaultdict(float)
    stack: list[list[float]] = []  # per open timer: [start, time spent in nested timers]

    def push() -> None:
        stack.append([clock(), 0.0])

    def pop(category: str) -> None:
        start, nested = stack.pop()
        spent = clock() - start
        totals[category] += spent - nested
        if stack:
            stack[-1][1] += spent

    def wrap(fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            push()
            try:
                return fn(*args, **kwargs)
            finally:
                pop(category)
        return timed

    handles = []
    categories = {"Linear": "linear", "RMSNorm": "norm", "MLP": "mlp activation (silu * up)",
                  "Attention": "attention module's own ops (views, transposes, copies)",
                  "DecoderLayer": "decoder layer's own ops (residual adds)",
                  "RotaryEmbedding": "rotary cos/sin"}
    for module in model.modules():
        name = type(module).__name__
        category = next((c for key, c in categories.items() if name.endswith(key)), None)
        if name == "Embedding":
            category = "embedding"
        if category is None:
            continue
        handles.append(module.register_forward_pre_hook(lambda *_: push()))
        handles.append(module.register_forward_hook(lambda *_, c=category: pop(c)))
    # The attention function is looked up by name at every call: wrap the registered one.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = attention_module.ATTN_IMPLEMENTATION
    original_attention = ALL_ATTENTION_FUNCTIONS[name]
    AttentionInterface.register(name, wrap(original_attention, "attention (SDPA / flash, merge)"))
    original_write = type(pool).write
    type(pool).write = wrap(original_write, "pool writes")
    # kvbaton's fused prefill (backend/compute/cpu/prefill.py) bypasses the nn.Linear modules and HF's RoPE.
    from kvbaton.backend.compute.cpu import kernels, prefill

    original_linear = prefill._Linear.__call__
    prefill._Linear.__call__ = wrap(original_linear, "linear")
    library = kernels.load()
    library_ops = {}
    if library is not None:
        for op, category in (("rope_inplace", "rope"), ("silu_mul", "mlp activation (silu * up)")):
            library_ops[op] = getattr(library, op)
            setattr(library, op, wrap(library_ops[op], category))
    patched_rope = []
    for module in list(model.modules()):
        mod = __import__(type(module).__module__, fromlist=["apply_rotary_pos_emb"])
        if hasattr(mod, "apply_rotary_pos_emb") and mod not in [m for m, _ in patched_rope]:
            patched_rope.append((mod, mod.apply_rotary_pos_emb))
            mod.apply_rotary_pos_emb = wrap(mod.apply_rotary_pos_emb, "rope")
    try:
        yield totals
    finally:
        for h in handles:
            h.remove()
        AttentionInterface.register(name, original_attention)
        type(pool).write = original_write
        prefill._Linear.__call__ = original_linear
        for op, fn in library_ops.items():
            setattr(library, op, fn)
        for mod, fn in patched_rope:
            mod.apply_rotary_pos_emb = fn


def run_chunks(engine: Any, tokens: list[int], chunk: int) -> torch.Tensor:
    """One prefill through the engine's runner on this thread, in chunks of ``chunk`` tokens."""
    from kvbaton.backend.compute.runner import Chunk

    pool = engine.pool
    blocks = pool.allocate(math.ceil(len(tokens) / pool.block_size))
    try:
        logits = None
        for start in range(0, len(tokens), chunk):
            logits = engine.runner.forward([Chunk(blocks, start, tokens[start : start + chunk])])[0]
        assert logits is not None
        return logits
    finally:
        pool.decref(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2500, help="prompt length (default 2500)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--variants", default="engine,hf", help=f"comma list of {', '.join(VARIANTS)} (default engine,hf)")
    parser.add_argument("--unfused", action="store_true", help="also time the engine with prefill fusions off")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: CPU time of the process (with --threads 1: the work done, robust to other load)")
    parser.add_argument("--quiet", type=float, default=0.10,
                        help="also report medians of the runs during which other processes used less than this "
                             "share of the CPUs (default 0.10)")
    parser.add_argument("--breakdown", action="store_true", help="time categories of one engine prefill")
    parser.add_argument("--torch-profile", type=int, default=0, metavar="N", help="top N torch ops of one prefill")
    parser.add_argument("--check", action="store_true", help="engine vs transformers last-token logits")
    args = parser.parse_args()

    from kvbaton.backend import Engine, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    print(f"load average at start: {load()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    t0 = time.perf_counter()
    engine = Engine(dtype=args.dtype, kv_budget="512MiB")
    print(f"engine ready in {time.perf_counter() - t0:.1f} s")
    tokens = prompt_tokens(engine, args.tokens)[: args.tokens]
    n = len(tokens)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.unfused:
        variants.append("engine-unfused")
    engines = {"engine": engine}
    if "engine-one" in variants:
        engines["engine-one"] = Engine(dtype=args.dtype, kv_budget="512MiB", max_batch_tokens=max(n, 2048))
    if "engine-512" in variants:
        engines["engine-512"] = Engine(dtype=args.dtype, kv_budget="512MiB", max_batch_tokens=512)
    hf = load_model(dtype=args.dtype, attn_implementation="sdpa").model if "hf" in variants or args.check else None
    ids = torch.tensor([tokens])
    from kvbaton.backend.compute.cpu import prefill

    def run(variant: str) -> float:
        with Others() as others:
            elapsed = run_once(variant)
        shares[variant].append(others.share)
        return elapsed

    def run_once(variant: str) -> float:
        if variant == "hf":
            start = clock()
            with torch.inference_mode():
                hf(ids, logits_to_keep=1)
            return clock() - start
        eng = engines["engine" if variant == "engine-unfused" else variant]
        with prefill.disabled() if variant == "engine-unfused" else contextlib.nullcontext():
            eng.flush_cache()
            start = clock()
            handle = eng.materialize(tokens)
            elapsed = clock() - start
            eng.release(handle)
        return elapsed

    print(f"prompt: {n} tokens; variants: {', '.join(variants)}")
    for v in variants:  # warm-up (allocator, oneDNN primitives)
        run_once(v)
    times: dict[str, list[float]] = {v: [] for v in variants}
    shares: dict[str, list[float]] = {v: [] for v in variants}
    loads = [load()]
    for r in range(args.repeats):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            times[v].append(run(v))
        loads.append(load())
    print(f"\ncold prefill of {n} tokens, {args.repeats} alternating rounds, {args.clock} time, "
          f"{torch.get_num_threads()} threads (development measurement)")
    for v in variants:
        ts = times[v]
        med = statistics.median(ts)
        print(f"  {v:15s} median {med:6.3f} s  [{min(ts):.3f}-{max(ts):.3f}]  {n / med:6.1f} tok/s; "
              f"other processes' CPU share per run: {' '.join(f'{x:.0%}' for x in shares[v])}")
    quiet = {v: [t for t, x in zip(times[v], shares[v]) if x < args.quiet] for v in variants}
    if all(len(q) >= 3 for q in quiet.values()):
        print(f"  runs during which other processes used < {args.quiet:.0%} of the CPUs:")
        for v in variants:
            med = statistics.median(quiet[v])
            print(f"  {v:15s} median {med:6.3f} s  [{min(quiet[v]):.3f}-{max(quiet[v]):.3f}] of {len(quiet[v])} runs")
    else:
        print(f"  (fewer than 3 runs of some variant had other processes under {args.quiet:.0%} of the CPUs)")
    if "hf" in times:
        for v in variants:
            if v != "hf":
                print(f"  {v} / hf: {statistics.median(times[v]) / statistics.median(times['hf']):.3f}")
    print(f"  load average per round: {' | '.join(loads)}")

    chunk = engine.scheduler.max_batch_tokens  # what a lone prompt gets (Scheduler.chunk_tokens)
    modes = [("fused", contextlib.nullcontext)] + ([("unfused", prefill.disabled)] if args.unfused else [])
    for label, context in modes if args.breakdown else []:
        with context():
            run_chunks(engine, tokens, chunk)  # warm
            # On this thread: with --clock cpu its CPU time (all of the work with --threads 1).
            timer = time.thread_time if args.clock == "cpu" else time.perf_counter
            with timers(engine.loaded.model, engine.pool, timer) as totals:
                start = timer()
                run_chunks(engine, tokens, chunk)
                total = timer() - start
        print(f"\nbreakdown of one engine prefill, {label} ({n} tokens, chunks of {chunk}): {total:.3f} s, "
              f"load {load()}")
        rest = total - sum(totals.values())
        for category, spent in sorted(totals.items(), key=lambda kv: -kv[1]) + [("rest (embedding, LM head, Python)", rest)]:
            print(f"  {category:58s} {spent:7.3f} s  {100 * spent / total:5.1f}%")
    for label, context in modes if args.torch_profile else []:
        from torch.profiler import ProfilerActivity, profile

        with context(), profile(activities=[ProfilerActivity.CPU]) as prof:
            run_chunks(engine, tokens, chunk)
        print(f"\ntorch ops of one engine prefill, {label}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.torch_profile))
    if args.check:
        with torch.inference_mode():
            theirs = hf(ids, logits_to_keep=1).logits[0, -1].float()
        for label, context in modes:
            for size in sorted({chunk, 512, n}):
                with context():
                    ours = run_chunks(engine, tokens, size).float()
                print(f"last-token logits, {label}, chunks of {size}: max |engine - transformers| = "
                      f"{(ours - theirs).abs().max().item():.3g}; "
                      f"argmax {'equal' if ours.argmax() == theirs.argmax() else 'DIFFERENT'}")
    print(f"load average at end: {load()}")


if __name__ == "__main__":
    main()
