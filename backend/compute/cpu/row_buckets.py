"""Row buckets: a bounded set of matrix-product shapes, so that a long-running server's memory stays bounded.

oneDNN, which runs PyTorch's CPU matrix products for pre-packed fp32 weights (the fused prefill) and
for bf16/fp16 weights (every linear of a bf16 model), builds a primitive and JIT-compiles kernels for
every distinct input shape, and keeps them: neither ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` nor the
allocator gives the memory back. A server sees prompts, chunks and batches of every length, so each
new row count adds kernels for every weight shape, without bound. Rounding the rows up to a bucket
(:func:`bucket`) bounds the distinct shapes to a few dozen per weight; the padding rows are zeros
whose outputs are dropped.

oneDNN computes each row of a product independently of how many rows come with it (checked here,
fp32 packed and bf16: the same bits for a row whatever the row count, ``tests/test_row_buckets.py``),
so bucketing changes no result. The cost is the padding's arithmetic: fewer than 16 rows on a
chunk of 33 to 256 rows, fewer than 32 on a longer one, under twice the rows of a smaller one.

fp32 products on plain weights run on MKL, which keeps no per-shape state: they are left alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Rows round up to the next power of two up to 32 (a decode step of one row stays one row), to a
# multiple of FINE_STEP up to FINE_LIMIT (a later turn's chunk of a few hundred new tokens: padding
# to 32 cost such a chunk ~5% of its products), and to a multiple of STEP above: 6 + (FINE_LIMIT - 32)
# / FINE_STEP + (max_batch_tokens - FINE_LIMIT) / STEP shapes per weight at most.
STEP = 32
FINE_STEP = 16
FINE_LIMIT = 256
_PATCHED = "_kvbaton_row_buckets"


def bucket(rows: int) -> int:
    """The row count a product of ``rows`` rows runs with."""
    if rows <= 32:
        return 1 << max(rows - 1, 0).bit_length()
    step = FINE_STEP if rows <= FINE_LIMIT else STEP
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` (2-D) with zero rows appended up to :func:`bucket` of its row count (itself when already there)."""
    rows = x.shape[0]
    target = bucket(rows)
    return x if target == rows else F.pad(x, (0, 0, 0, target - rows))


def _applies(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


class _BucketedLinear:
    """An ``nn.Linear`` module's forward with its rows bucketed (the module's own forward underneath)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.original = module.forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or bucket(rows) == rows:
            return self.original(x)
        y = self.original(pad_rows(x.reshape(rows, x.shape[-1])))[:rows]
        return y.view(*x.shape[:-1], y.shape[-1])


def install(model: Any, device: torch.device, dtype: torch.dtype) -> int:
    """Bucket the rows of every linear module of this model instance (never its class) whose products
    run on oneDNN (bf16/fp16 on CPU); the number of modules patched (0 when it does not apply)."""
    if not _applies(dtype, device) or getattr(model, _PATCHED, False):
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = _BucketedLinear(module)
            count += 1
    setattr(model, _PATCHED, True)
    log.info("row buckets on %d %s linears (bounded oneDNN kernel cache)", count, dtype)
    return count
