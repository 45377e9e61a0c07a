"""The GPU benchmark's ``device`` phase (:mod:`kvbaton.bench.gpu`): the GPU's two ceilings (a large
device-to-device copy, a large bf16 matrix product) and the CUDA runner's attention kernels (and FlashAttention
varlen) against the torch reference on fresh random data, in fp32 and bf16, with their times; then each kind of
local prefill attention the runner may pick (``ops.LOCAL_KINDS``: SDPA's cuDNN and FlashAttention backends...)
on one fresh prompt of 4K, 16K and 32K tokens with the 1B and 8B shapes' heads, timed (and their agreement with
the first kind that ran), which is the attention of a long prompt's first chunk. CUDA only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from kvbaton.bench.gpu_harness import Bench, Phase, free_memory


def device_phase(bench: Bench, phase: Phase) -> None:
    """The ceilings of the GPU and the kernels against the reference (CUDA only)."""
    if not bench.cuda():
        phase.out["skipped"] = "CPU: the kernels run on CUDA (tests/test_cuda_kernels.py runs them under Triton's interpreter)"
        return
    from triton.testing import do_bench

    device = torch.device(bench.device)
    phase.out.update(ceilings(device, do_bench))
    free_memory(bench.device)
    phase.check("the kernel checks")
    phase.out["kernels"] = kernel_checks(device, do_bench)
    free_memory(bench.device)
    phase.check("local prefill attention at long context")
    phase.out["local_attention"] = []
    for heads, kv_heads, d in ((32, 8, 64), (32, 8, 128)):
        for n in (4096, 16384, 32768):
            phase.check(f"local prefill attention over {n} tokens, head size {d}")
            phase.out["local_attention"] += local_checks(device, do_bench, heads, kv_heads, d, n)
            phase.save()
            free_memory(bench.device)


def ceilings(device: torch.device, do_bench: Callable[..., float]) -> dict[str, float]:
    """The copy bandwidth (bytes read + written per second, 1 GiB each way) and the bf16 matrix-product rate
    (8192 x 8192 x 8192) of the device, medians of Triton's ``do_bench`` (CUDA events) on random data."""
    src = torch.randn(2**29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    matmul_ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return {"copy_bandwidth_bytes_per_s": 2 * src.nbytes / (copy_ms / 1000),
            "bf16_matmul_flop_per_s": 2 * 8192**3 / (matmul_ms / 1000)}


def kernel_checks(device: torch.device, do_bench: Callable[..., float]) -> list[dict[str, Any]]:
    """Each attention kernel (and FlashAttention varlen) against the torch reference on fresh random data: the
    relative error ``|out - ref| / |ref|`` (reference in fp32) and the median time."""
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, d in ((32, 8, 64), (32, 8, 128)):
            gen = torch.Generator().manual_seed(heads + d)
            results += _decode_checks(gen, device, dtype, heads, kv_heads, d, do_bench)
            results += _prefill_checks(gen, device, dtype, heads, kv_heads, d, do_bench)
            free_memory(str(device))
    return results


def _decode_checks(gen: torch.Generator, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, d: int,
                   do_bench: Callable[..., float]) -> list[dict[str, Any]]:
    from kvbaton.backend.compute.cuda import kernels
    from kvbaton.backend.compute.cuda.ops import TorchOps
    from kvbaton.backend.compute.cuda.step import StepBatch

    block_size, blocks = 16, 4096
    lengths = [1, 15, 511, 2049, 4096]
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, at = [], 0
    for length in lengths:  # scattered, disjoint block tables
        need = -(-length // block_size)
        tables.append(order[at : at + need])
        at += need
    width = max(len(t) for t in tables)
    ints = {"dtype": torch.int32, "device": device}
    batch = StepBatch(input_ids=torch.zeros(len(lengths), **ints), positions=torch.zeros(len(lengths), **ints),
                      slots=torch.full((len(lengths),), -1, **ints),
                      block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **ints),
                      context_lens=torch.tensor(lengths, **ints), block_size=block_size)
    k = torch.randn(kv_heads, blocks * block_size, d, generator=gen).to(dtype).to(device)
    v = torch.randn(kv_heads, blocks * block_size, d, generator=gen).to(dtype).to(device)
    q = torch.randn(len(lengths), heads, d, generator=gen).to(dtype).to(device)
    want = TorchOps().decode(q.float(), k.float(), v.float(), batch, d**-0.5)
    out = []
    for splits in (1, 8):
        def run(splits: int = splits) -> torch.Tensor:
            return kernels.decode_attention(q, k, v, batch.block_tables, batch.context_lens, block_size, d**-0.5,
                                            splits)

        out.append({"kernel": f"decode, {splits} splits", "dtype": str(dtype), "heads": [heads, kv_heads, d],
                    "error": _relative(run(), want), "ms": do_bench(run, return_mode="median"), "context": lengths})
    return out


def _prefill_checks(gen: torch.Generator, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                    d: int, do_bench: Callable[..., float]) -> list[dict[str, Any]]:
    from kvbaton.backend.compute.cuda import kernels
    from kvbaton.backend.compute.cuda.ops import TorchOps, flash_varlen, random_prefill

    order = torch.randperm(1024, generator=gen).tolist()
    # A fresh 300-token prompt behind 100 cached tokens, and 1000 tokens behind 2000 cached ones.
    batch, q, k, v = random_prefill(gen, [order[:25], order[25:213]], [100, 2000], [300, 1000], heads, kv_heads, d, 16,
                                    1024, dtype, device)
    want = TorchOps().prefill(q.float(), k.float(), v.float(), batch, d**-0.5)

    def triton_prefill() -> torch.Tensor:
        return kernels.prefill_attention(q, k, v, batch.block_tables, batch.cu_q, batch.positions, batch.max_q,
                                         batch.block_size, d**-0.5)

    def flash() -> torch.Tensor:
        return flash_varlen(q, k, v, batch, d**-0.5)

    out = [{"kernel": "prefill (triton)", "dtype": str(dtype), "heads": [heads, kv_heads, d],
            "error": _relative(triton_prefill(), want), "ms": do_bench(triton_prefill, return_mode="median")}]
    if dtype != torch.float32:
        try:
            out.append({"kernel": "prefill (flash varlen)", "dtype": str(dtype), "heads": [heads, kv_heads, d],
                        "error": _relative(flash(), want), "ms": do_bench(flash, return_mode="median")})
        except Exception as exc:  # noqa: BLE001 - recorded: the runner then prefills with the Triton kernel
            out.append({"kernel": "prefill (flash varlen)", "dtype": str(dtype), "heads": [heads, kv_heads, d],
                        "error": None, "failed": f"{type(exc).__name__}: {exc}"})
    return out


def local_checks(device: torch.device, do_bench: Callable[..., float], heads: int, kv_heads: int, d: int,
                 n: int) -> list[dict[str, Any]]:
    """Every local prefill attention kind on one fresh bf16 prompt of ``n`` tokens: its median time, its
    attention TFLOP/s (causal: 2 n^2 heads d), its relative difference from the first kind that ran."""
    from kvbaton.backend.compute.cuda.ops import LOCAL_KINDS, fused_qkv, local_attention
    from kvbaton.backend.compute.cuda.step import StepBatch

    q, k, v = fused_qkv(torch.Generator().manual_seed(n + d), n, heads, kv_heads, d, torch.bfloat16, device)
    ints = {"dtype": torch.int32, "device": device}
    batch = StepBatch(input_ids=torch.zeros(n, **ints), positions=torch.arange(n, **ints),
                      slots=torch.zeros(n, **ints), block_tables=torch.zeros(1, 1, **ints),
                      context_lens=torch.tensor([n], **ints), block_size=16, cu_q=torch.tensor([0, n], **ints),
                      max_q=n, local=True, q_bounds=(0, n))
    flops = 2.0 * n * n * heads * d
    out, first = [], None
    for kind in LOCAL_KINDS:
        entry: dict[str, Any] = {"kind": kind, "tokens": n, "heads": [heads, kv_heads, d]}
        try:
            got = local_attention(kind, q, k, v, batch, d**-0.5)
            ms = do_bench(lambda kind=kind: local_attention(kind, q, k, v, batch, d**-0.5), warmup=5, rep=30,
                          return_mode="median")
            entry.update(ms=ms, tflops=flops / (ms / 1000) / 1e12)
            if first is None:
                first = got
            else:
                entry["vs_first"] = _relative(got, first)
        except Exception as exc:  # noqa: BLE001 - a backend this GPU or build lacks: recorded
            entry["failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out.append(entry)
    return out


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
