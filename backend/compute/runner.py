"""The model-runner seam: what the runtime asks of the hardware, and nothing else.

The runtime (the batching :mod:`~kvbaton.backend.runtime.scheduler`, the request
:mod:`~kvbaton.backend.runtime.lifecycle`) talks to the model through :class:`ModelRunner` only:

- :meth:`ModelRunner.forward` runs one packed batch of :class:`Chunk` s — prefill chunks, decode steps (a
  chunk of one token), and sparse chunks whose tokens sit at explicit positions among cached ones
  (selective recomputation) — writes their K/V into the block pool and returns their logits;
- :meth:`ModelRunner.deviation` is cross-prefix reuse's probe: how far re-aligned K/V are from what
  this sequence's real context would give.

Implementations, chosen in one place (:func:`~kvbaton.backend.compute.selector.select_runner`):

- :class:`~kvbaton.backend.compute.eager.EagerRunner`: the Hugging Face model definition over the paged pool,
  with the CPU's fused prefill and decode step (``cpu/``: oneDNN-packed weights, kvbaton's C++ kernels);
- ``cuda/``: :class:`~kvbaton.backend.compute.cuda.runner.CudaGraphRunner`, decode replayed from CUDA graphs
  per batch bucket, paged attention in Triton, varlen prefill through FlashAttention-2 (issue 38);
- ``tests/fakes.py``'s ``FakeRunner``: deterministic logits and K/V rows without a model, for model-free
  tests of the memory subsystem.

This module imports nothing of kvbaton's above it, so the runtime does not depend on any implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Chunk:
    """New tokens of one sequence. ``blocks`` must already cover positions ``0..start+len(tokens)-1``."""

    blocks: Sequence[int]
    start: int
    token_ids: Sequence[int]
    all_logits: bool = False  # logits of every token (fidelity measurement), not just the last
    # Explicit ascending positions (selective recomputation): the tokens sit at these positions among
    # K/V already in the pool, each seeing every position up to its own; ``start`` is the first of them.
    positions: Sequence[int] | None = None


@runtime_checkable
class ModelRunner(Protocol):
    """One model's forward passes over one block pool. Called from one thread at a time (the scheduler's).

    Invariants: every chunk's K/V are in the pool at its positions when :meth:`forward` returns, and a
    token's K/V and logits depend only on the tokens at and before its position (not on what else is in
    the batch, nor on how the sequence was split into chunks), so a cached prefix is as good as recomputing it.
    """

    def forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """Write the chunks' K/V into the pool; return fp32 logits per chunk: ``[vocab]`` for its last token,
        or ``[tokens, vocab]`` when the chunk asks for all of them. Each tensor has storage of its own."""
        ...

    def deviation(self, blocks: Sequence[int], start: int, token_ids: Sequence[int]) -> torch.Tensor:
        """``[len(token_ids)]``: how far the K/V in the pool at positions ``start..`` (computed in another context
        and re-aligned) are from what the real context before ``start`` gives these tokens (0: the same)."""
        ...


class RunnerUnavailable(RuntimeError):
    """A runner that cannot run here; the message says why (no device, not built, not implemented)."""
