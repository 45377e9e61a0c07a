"""bf16 honesty for the GPU benchmark's speed phases (:mod:`kvbaton.bench.gpu_speed`): the logit error of kvbaton's
bf16 forward against an fp32 reference of the same weights, next to transformers' own bf16 error against that
reference, rather than greedy agreement on random weights alone (which says little: 16.7% on the last run).

Teacher-forced over a few random prompts: kvbaton's logits of every position, the prompt's head through the
prefill step (a fresh prompt: the local attention path) and its last tokens as rows of the decode step (the
path a resume's question and every decode step take); transformers' bf16 logits of the same prompts; then, with
both freed, the fp32 reference (the bf16 checkpoint loaded in fp32: the same weights, exactly) on the device.
Reported per path: the largest and the mean absolute logit error, the KL divergence of the next-token
distribution from the reference's (mean and largest over positions) and how often the top token agrees.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from kvbaton.bench.gpu_harness import Bench, Phase, free_memory, hf_model, random_tokens

Logits = list[tuple[torch.Tensor, torch.Tensor]]  # per prompt: (prefill positions, decode-row positions), on CPU


def prompts_for(bench: Bench, vocab: int) -> list[list[int]]:
    return [random_tokens(bench.plan.logit_tokens, vocab, seed=500 + i) for i in range(bench.plan.logit_prompts)]


def tail_rows(tokens: int) -> int:
    """How many of a prompt's last tokens run as decode rows (a resume's question is about this long)."""
    return max(1, min(16, tokens // 4))


@torch.inference_mode()
def kvbaton_logits(engine: Any, prompts: Sequence[Sequence[int]], device: str) -> tuple[Logits, dict[str, Any]]:
    """Every position's logits from the engine's model and kernels, on a pool of their own (the engine's stays
    as it is): the head of each prompt as one prefill chunk, its tail as decode rows. CUDA: the CUDA runner with
    graphs off (a graph replays the same step); elsewhere the engine's runner kind."""
    from kvbaton.backend.cache.block_pool import BlockPool
    from kvbaton.backend.compute.runner import Chunk
    from kvbaton.backend.compute.selector import select_runner

    loaded = engine.loaded
    n = len(prompts[0])
    tail = tail_rows(n)
    per = -(-n // engine.pool.block_size)
    pool = BlockPool(engine.pool.shape, per * len(prompts), loaded.device)
    if device.startswith("cuda"):
        from kvbaton.backend.compute.cuda.runner import CudaGraphRunner

        runner: Any = CudaGraphRunner(loaded, pool, graphs=False)
    else:
        runner = select_runner(loaded, pool)
    out = []
    for i, prompt in enumerate(prompts):
        table = list(range(i * per, (i + 1) * per))
        head = runner.forward([Chunk(table, 0, list(prompt[: n - tail]), all_logits=True)])[0]
        rows = runner.forward([Chunk(table, n - tail, list(prompt[n - tail :]), all_logits=True)])[0]
        out.append((head.float().cpu(), rows.float().cpu()))
    about = {"runner": type(runner).__name__, "ops": getattr(getattr(runner, "ops", None), "name", None),
             "forwards": dict(getattr(runner, "forwards", {}))}
    return out, about


@torch.inference_mode()
def transformers_logits(hf: Any, prompts: Sequence[Sequence[int]], device: str) -> list[torch.Tensor]:
    return [hf(torch.tensor([list(p)], device=device)).logits[0].float().cpu() for p in prompts]


@torch.inference_mode()
def compare(bench: Bench, phase: Phase, ckpt: Path, prompts: Sequence[Sequence[int]], ours: Logits,
            theirs: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Load the fp32 reference (call with the bf16 models freed) and measure both against it (see the module)."""
    device = bench.device
    phase.check("the fp32 reference")
    reference = hf_model(ckpt, "float32", device)
    tail = tail_rows(len(prompts[0]))
    errors: dict[str, _Error] = {"kvbaton_prefill": _Error(), "kvbaton_decode_rows": _Error(),
                                 "transformers": _Error()}
    for prompt, (head, rows), hf_logits in zip(prompts, ours, theirs):
        want = reference(torch.tensor([list(prompt)], device=device)).logits[0].float()
        errors["kvbaton_prefill"].add(head.to(device), want[:-tail])
        errors["kvbaton_decode_rows"].add(rows.to(device), want[-tail:])
        errors["transformers"].add(hf_logits.to(device), want)
    del reference
    free_memory(device)
    return {"prompts": len(prompts), "tokens": len(prompts[0]), "decode_rows": tail,
            **{name: e.summary() for name, e in errors.items()}}


class _Error:
    """Running logit error against the reference over many positions."""

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.abs_sum = 0.0
        self.values = 0
        self.kl: list[torch.Tensor] = []
        self.top1 = 0
        self.positions = 0

    def add(self, got: torch.Tensor, want: torch.Tensor) -> None:
        diff = (got - want).abs()
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.abs_sum += float(diff.double().sum())
        self.values += diff.numel()
        log_want, log_got = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
        self.kl.append((log_want.exp() * (log_want - log_got)).sum(-1).clamp_min(0).cpu())
        self.top1 += int((got.argmax(-1) == want.argmax(-1)).sum())
        self.positions += got.shape[0]

    def summary(self) -> dict[str, float]:
        kl = torch.cat(self.kl) if self.kl else torch.zeros(1)
        return {"max_abs": self.max_abs, "mean_abs": self.abs_sum / max(1, self.values),
                "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agreement": self.top1 / max(1, self.positions),
                "positions": self.positions}
