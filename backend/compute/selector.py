"""Which runner and which attention run a model: the one place compute backends are chosen.

Given the loaded model (its device, dtype and architecture), :func:`select_runner` picks the
:class:`~.runner.ModelRunner` and :func:`attention_backend` how its paged attention runs:

- CPU: the eager runner (:class:`~.eager.EagerRunner`) with the fused prefill and row buckets installed on the
  engine's model instance (``cpu/prefill.py``, ``cpu/row_buckets.py``: once per model, the reference models
  transformers loads separately are never touched), the fused decode step (``cpu/fast_decode.py``, on
  kvbaton's C++ kernels where they build), kvbaton's causal kernel over the pool and split prefix attention;
- CUDA: the CUDA graph runner (``cuda/runner.CudaGraphRunner``: decode replayed from CUDA graphs per batch
  bucket, Triton paged attention, FlashAttention-2 varlen prefill) for the families the registry says it
  implements (``models.paths``) where Triton is installed; otherwise (its reason logged once: a feature it does
  not implement, such as sliding windows, no Triton, ``KVBATON_CUDA_RUNNER=0``)
  the eager runner with SDPA over the pool and the fused decode step's torch path;
- anything else: the eager runner with SDPA.

Each piece decides itself whether it applies to the model and dtype (and logs why not), as before; this
module only says which pieces a device gets.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from ..cache.block_pool import BlockPool
from .attention import SDPA, AttentionBackend
from .cpu import prefill, row_buckets
from .cpu.fast_decode import FastDecoder
from .cuda import runner as cuda
from .eager import EagerRunner
from .loader import LoadedModel
from .runner import ModelRunner

log = logging.getLogger(__name__)

_PREPARED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models with the CPU's fused prefill decided
_LOCK = threading.Lock()
_LOGGED: set[str] = set()


def _cpu_kernel(query: torch.Tensor, pool: BlockPool, layer: int, read_slots: torch.Tensor | slice,
                scaling: float | None, positions: torch.Tensor | None, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor | None:
    # Looked up at every call, so prefill.disabled() and a test's stand-in apply.
    return prefill.attention(query, pool, layer, read_slots, scaling, positions, window, softcap)


CPU = AttentionBackend("cpu", fused=_cpu_kernel, split_prefix=True)


def attention_backend(device: torch.device) -> AttentionBackend:
    """How paged attention runs on ``device``: kvbaton's kernel and split prefixes on CPU, SDPA elsewhere."""
    return CPU if device.type == "cpu" else SDPA


def select_runner(loaded: LoadedModel, pool: BlockPool, *, fast_decode: bool = True) -> ModelRunner:
    """The runner of ``loaded`` over ``pool``: see the module. ``fast_decode=False``: decode steps run the model's
    own forward too (A/B checks)."""
    if loaded.device.type == "cuda":
        reason = cuda.unavailable_reason(loaded)
        if reason is None:
            try:
                return cuda.CudaGraphRunner(loaded, pool)
            except Exception as exc:  # a GPU or build it cannot start on: the eager runner is correct
                log.exception("the CUDA graph runner failed to start")
                reason = f"it failed to start: {type(exc).__name__}: {exc}"
        _log_once(f"CUDA graph runner unavailable ({reason}): the eager runner runs on {loaded.device}")
    elif loaded.device.type == "cpu":
        _prepare_cpu(loaded.model, loaded.device, loaded.dtype)
    fast = FastDecoder.build(loaded, pool) if fast_decode else None
    return EagerRunner(loaded, pool, attention_backend(loaded.device), fast)


def _prepare_cpu(model: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Install the fused prefill and the row buckets on the engine's model instance, once (each logs why not)."""
    with _LOCK:
        if model in _PREPARED:
            return
        prefill.install(model, device, dtype)
        row_buckets.install(model, device, dtype)
        _PREPARED.add(model)


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.info(message)
