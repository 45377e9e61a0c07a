"""Host time of the request loop, without a model: what the scheduler itself costs per sequence per step.

A runner that computes nothing (its logits are rows of one preallocated tensor, it writes no K/V) takes
the model's place under the engine's own scheduler, KV manager and lifecycle, so every microsecond
measured is host work: scheduling (rows, budget, block growth), postprocessing (batched sampling, stop
rules, one queue put per request per step), and the consumers' reading (detokenizing, stream chunks), on
this machine's cores like the engine's threads.

- ``decode``: N concurrent greedy generations (1, 8, 64, 256), each read by its own consumer thread; per
  step, the scheduler thread's host time (schedule + postprocess: ``Scheduler.host_s``), divided by the
  sequences stepped. Target (issue 45): <= 20 us per sequence per step at 64 sequences: the host budget
  that 15,000 tokens/s at 64 agents on a GPU leaves.
- ``resume``: the fixed cost of a resume on an idle engine: a handle's one-token continuation (prefix
  shared, one decode row, one sampled token) from the call to its result. Target: <= 1 ms.

Every repeat is kept (median [min-max] reported).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from kvbaton.bench.spread import cell, measured
from kvbaton.types import SamplingParams

VOCAB = 1024
SEQUENCES = (1, 8, 64, 256)


class NullRunner:
    """:class:`~kvbaton.backend.compute.runner.ModelRunner` that computes nothing: greedy decoding after it
    always picks token ``1``; K/V are not written."""

    def __init__(self, rows: int = 4096, vocab: int = VOCAB) -> None:
        self.logits = torch.zeros(rows, vocab)
        self.logits[:, 1] = 1.0
        self.forward_s = 0.0

    def forward(self, chunks: Sequence[Any]) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        out = [self.logits[: len(c.token_ids)] if c.all_logits else self.logits[i] for i, c in enumerate(chunks)]
        self.forward_s += time.perf_counter() - t0
        return out

    def deviation(self, blocks: Sequence[int], start: int, token_ids: Sequence[int]) -> torch.Tensor:
        return torch.zeros(len(token_ids))


class _Tokenizer:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


def build(blocks: int = 65536) -> Any:
    """A lifecycle and scheduler over a null runner (no prefix cache: nothing to match)."""
    from kvbaton.backend.cache.block_pool import BlockPool, PoolShape
    from kvbaton.backend.cache.kv_manager import KVManager
    from kvbaton.backend.cache.sequence import KVState
    from kvbaton.backend.compute.loader import LoadedModel
    from kvbaton.backend.events import EventRing
    from kvbaton.backend.handles import HandleTable, Identity
    from kvbaton.backend.runtime.lifecycle import Lifecycle
    from kvbaton.backend.runtime.scheduler import Scheduler
    from kvbaton.handle import Placement, Positions

    pool = BlockPool(PoolShape(num_layers=1, num_kv_heads=1, head_dim=2, block_size=16, dtype=torch.float32), blocks)
    handles: HandleTable[KVState] = HandleTable(Identity(
        model="null", fingerprint="0" * 32, tokenizer_fingerprint="0" * 32,
        positions=Positions(rope_type="default", rope_theta=10000.0), placement=Placement(device="cpu")))
    kv = KVManager(pool, None, threading.RLock(), live=handles.states)
    runner = NullRunner()
    scheduler = Scheduler(runner, kv, max_batch_tokens=8192, prefill_chunk=2048, max_batch_seqs=256)
    loaded = LoadedModel(
        name="null", path=None, model=None, tokenizer=_Tokenizer(), dtype=torch.float32,  # type: ignore[arg-type]
        device=torch.device("cpu"), fingerprint="0" * 32, tokenizer_fingerprint="0" * 32, rope_type="default",
        rope_theta=10000.0, rope_parameters={}, max_context=1 << 20, num_layers=1, num_kv_heads=1, head_dim=2,
        vocab_size=VOCAB, eos_token_ids=frozenset({0}),
    )
    return Lifecycle(kv, scheduler, handles, loaded, EventRing(64)), runner


def _state(life: Any, tokens: list[int]) -> Any:
    from kvbaton.handle import LineageStep, Op

    return life._kv.share(None, 0, tokens, LineageStep(op=Op.GENERATE, token_ids=tuple(tokens)))


def decode_host_us(n: int, steps: int) -> dict[str, float]:
    """``n`` generations of ``steps`` tokens at once: the scheduler's host time per sequence per step (us)."""
    life, _ = build()
    scheduler = life.scheduler
    try:
        streams = [life.stream(_state(life, [2 + i % 500] * 16), SamplingParams(max_tokens=steps, ignore_eos=True))
                   for i in range(n)]
        # consumers: one thread each, as the SDK's callers and the server's workers are
        threads = [threading.Thread(target=s.until_done, daemon=True) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        rows = scheduler.steps
        per_step = scheduler.host_s / max(1, rows)
        stepped = n * steps / max(1, rows)  # sequences per step, on average
        return {"host_us_per_seq_step": per_step / stepped * 1e6, "steps": rows, "seqs_per_step": stepped,
                "host_ms_per_step": per_step * 1e3}
    finally:
        scheduler.close()


def resume_fixed_ms(repeats: int) -> list[float]:
    """A handle's one-token continuation on an idle engine, call to result (ms), ``repeats`` times."""
    from kvbaton.handle import LineageStep, Op

    life, _ = build()
    try:
        parent = _state(life, list(range(2, 202)))
        life.prefill(parent)
        times = []
        for _ in range(repeats + 5):
            child = life._kv.share(parent, parent.num_tokens, [7], LineageStep(op=Op.RESUME, parent=parent.id))
            t0 = time.perf_counter()
            result = life.stream(child, SamplingParams(max_tokens=1)).until_done()
            times.append((time.perf_counter() - t0) * 1e3)
            life.release(child)
            assert result.token_ids == [1]
        return times[5:]  # the first few warm the allocator and the caches
    finally:
        life.scheduler.close()


def run(repeats: int, steps: int, sequences: Sequence[int]) -> dict[str, Any]:
    rows = []
    for n in sequences:
        runs = [decode_host_us(n, steps) for _ in range(repeats)]
        row: dict[str, Any] = {"sequences": n, "steps_per_run": steps}
        measured(row, "host_us_per_seq_step", [r["host_us_per_seq_step"] for r in runs])
        measured(row, "host_ms_per_step", [r["host_ms_per_step"] for r in runs])
        row["seqs_per_step"] = statistics.median(r["seqs_per_step"] for r in runs)
        rows.append(row)
    resume: dict[str, Any] = {"repeats": repeats * 50}
    measured(resume, "resume_fixed_ms", resume_fixed_ms(repeats * 50))
    return {"rows": rows, "resume": resume, "targets": {"host_us_per_seq_step_at_64": 20.0, "resume_fixed_ms": 1.0}}


def table(payload: dict[str, Any]) -> str:
    from kvbaton.bench.common import format_table

    lines = format_table(
        ["sequences", "host us / seq / step", "host ms / step", "seqs / step"],
        [[r["sequences"], cell(r, "host_us_per_seq_step"), cell(r, "host_ms_per_step"), f"{r['seqs_per_step']:.1f}"]
         for r in payload["rows"]])
    return lines + f"\n\nresume fixed cost: {cell(payload['resume'], 'resume_fixed_ms')} ms (target <= 1 ms)"


def main(argv: list[str] | None = None) -> None:
    from kvbaton.bench import record

    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs per concurrency (all kept)")
    parser.add_argument("--steps", type=int, default=200, help="tokens each generation decodes")
    parser.add_argument("--sequences", type=int, nargs="+", default=list(SEQUENCES))
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 repeats of 40 steps at 1 and 8")

    def measure(args: argparse.Namespace) -> dict[str, Any]:
        if args.quick:
            return run(1, 40, (1, 8))
        return run(args.repeats, args.steps, args.sequences)

    record.measure_and_write(parser, "host", argv, measure, table)


if __name__ == "__main__":
    main()
