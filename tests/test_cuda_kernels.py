"""The CUDA runner's Triton kernels against the torch reference (``ops.TorchOps``).

Without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before the kernels are
defined), which executes the same kernel code on CPU tensors. Skipped where Triton is not installed (CI has
neither Triton nor CUDA); a session with Triton runs them with ``.venv-triton/bin/python -m pytest``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.unit

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit runs
pytest.importorskip("triton", reason="Triton is not installed (CI has no Triton and no CUDA)")

from kvbaton.backend.compute.cuda import kernels
from kvbaton.backend.compute.cuda.ops import TorchOps, random_prefill, table_slots
from kvbaton.backend.compute.cuda.step import StepBatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def _decode_batch(gen: torch.Generator, lengths: list[int], block_size: int, num_blocks: int) -> StepBatch:
    """Sequences with the given context lengths over scattered (shuffled, disjoint) blocks of the pool."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for length in lengths:
        need = max(1, -(-length // block_size))
        tables.append(order[:need])
        order = order[need:]
    width = max(len(t) for t in tables)
    ints = {"dtype": torch.int32, "device": DEVICE}
    n = len(lengths)
    return StepBatch(input_ids=torch.zeros(n, **ints), positions=torch.tensor([max(0, x - 1) for x in lengths], **ints),
                     slots=torch.full((n,), -1, **ints),
                     block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **ints),
                     context_lens=torch.tensor(lengths, **ints), block_size=block_size)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (9, 3), (4, 4)])
def test_paged_decode_matches_the_reference_over_scattered_blocks(dtype, tolerance, heads, kv_heads):
    gen = torch.Generator().manual_seed(heads * 7 + kv_heads)
    block_size, num_blocks, d = 16, 64, 64
    # Lengths inside a block, on its edges and across many blocks; 0 is a padding row (a graph bucket's).
    lengths = [1, 15, 16, 17, 100, 257, 0]
    batch = _decode_batch(gen, lengths, block_size, num_blocks)
    k_cache = torch.randn(kv_heads, num_blocks * block_size, d, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, d, generator=gen).to(dtype).to(DEVICE)
    q = torch.randn(len(lengths), heads, d, generator=gen).to(dtype).to(DEVICE)
    want = TorchOps().decode(q.float(), k_cache.float(), v_cache.float(), batch, d**-0.5)
    for splits in (1, 4, 16):  # 16 splits of a 1-token context: 15 empty splits weigh nothing in the merge
        got = kernels.decode_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens, block_size,
                                       d**-0.5, splits=splits)
        assert got.dtype == dtype and got.shape == q.shape
        assert _relative(got[:-1], want[:-1]) < tolerance, splits
        assert torch.equal(got[-1].float(), torch.zeros_like(got[-1].float())), "a padding row reads nothing"


def test_paged_decode_with_a_block_size_that_is_not_the_tile():
    gen = torch.Generator().manual_seed(3)
    block_size, num_blocks, kv_heads, heads, d = 5, 80, 2, 4, 32
    batch = _decode_batch(gen, [3, 5, 6, 49, 123], block_size, num_blocks)
    k_cache = torch.randn(kv_heads, num_blocks * block_size, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, d, generator=gen).to(DEVICE)
    q = torch.randn(5, heads, d, generator=gen).to(DEVICE)
    want = TorchOps().decode(q, k_cache, v_cache, batch, 0.3)
    got = kernels.decode_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens, block_size, 0.3,
                                   splits=2, block_n=16)
    assert _relative(got, want) < 1e-5


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_varlen_prefill_matches_the_reference(dtype, tolerance):
    """Packed chunks: a fresh prompt, chunks behind cached tokens (not on block edges), a single token."""
    gen = torch.Generator().manual_seed(11)
    tables = [[9, 2, 14, 5], [0, 7, 3, 12, 1, 8], [4, 13, 6], [10, 11]]
    cached, fresh = [0, 37, 16, 20], [50, 40, 1, 9]
    batch, q, k_cache, v_cache = random_prefill(gen, tables, cached, fresh, 8, 2, 64, 16, 16, dtype, DEVICE)
    want = TorchOps().prefill(q.float(), k_cache.float(), v_cache.float(), batch, 0.125)
    got = kernels.prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_q, batch.positions,
                                    batch.max_q, batch.block_size, 0.125)
    assert got.dtype == dtype
    assert _relative(got, want) < tolerance


def test_prefill_at_sparse_positions_sees_keys_up_to_each_position():
    """Selective recomputation: tokens at explicit ascending positions among cached ones."""
    gen = torch.Generator().manual_seed(5)
    tables = [[6, 1, 4, 0, 7], [3, 2, 5]]
    batch, q, k_cache, v_cache = random_prefill(gen, tables, [0, 0], [3, 4], 6, 3, 32, 16, 8, torch.float32, DEVICE)
    batch.positions = torch.tensor([2, 31, 70, 0, 5, 6, 40], dtype=torch.int32, device=DEVICE)
    batch.dense = False
    want = TorchOps().prefill(q, k_cache, v_cache, batch, 0.2)
    got = kernels.prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_q, batch.positions,
                                    batch.max_q, batch.block_size, 0.2)
    assert _relative(got, want) < 1e-5


class _Shape:
    """What :meth:`TorchOps.rope_store` reads of the weights: head counts and the rotary tables."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, positions: int, dtype: torch.dtype) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.arange(positions).float()[:, None] * inv
        emb = torch.cat((freqs, freqs), -1)
        self.cos, self.sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_q_and_k_writes_k_and_v_at_their_slots_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, d = 6, 2, 64
    shape = _Shape(heads, kv_heads, d, 300, dtype)
    k_cache = torch.randn(kv_heads, 64, d, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(kv_heads, 64, d, generator=gen).to(dtype).to(DEVICE)
    # qkv as the step's fused projection gives it, a row of a wider tensor (strided)
    qkv = torch.randn(4, (heads + 2 * kv_heads + 3) * d, generator=gen).to(dtype).to(DEVICE)[:, : -3 * d]
    ints = {"dtype": torch.int32, "device": DEVICE}
    batch = StepBatch(input_ids=torch.zeros(4, **ints), positions=torch.tensor([0, 7, 299, 35], **ints),
                      slots=torch.tensor([17, -1, 3, 40], **ints), block_tables=torch.zeros(4, 1, **ints),
                      context_lens=torch.zeros(4, **ints), block_size=16)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_q = TorchOps().rope_store(qkv, shape, batch, want_k, want_v)
    got_q = kernels.rope_store(qkv, shape.cos, shape.sin, batch.positions, batch.slots, k_cache, v_cache, heads,
                               kv_heads)
    assert got_q.shape == (4, heads, d) and got_q.dtype == dtype
    # bf16: torch's roundings after each product and the sum, so the same values; fp32 may fuse a multiply-add
    assert _relative(got_q, want_q) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert _relative(k_cache, want_k) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(v_cache, want_v)
    untouched = [s for s in range(64) if s not in (17, 3, 40)]
    assert torch.equal(k_cache[:, untouched], want_k[:, untouched])
    # The same launch with k_out: the rotated k of every row (a padding row's too) also into a buffer of its own,
    # what a fresh prompt's prefill attends over instead of reading the pool back.
    k_out = torch.full((4, kv_heads, d), 7.0, dtype=dtype, device=DEVICE)
    again = kernels.rope_store(qkv, shape.cos, shape.sin, batch.positions, batch.slots, k_cache, v_cache, heads,
                               kv_heads, k_out=k_out)
    assert torch.equal(again, got_q)
    _, want_rotated, want_values = TorchOps().rope_store_kv(qkv, shape, batch, want_k.clone(), want_v.clone())
    assert _relative(k_out, want_rotated) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(k_out[[0, 2, 3]], k_cache[:, [17, 3, 40]].transpose(0, 1))
    assert torch.equal(want_values, qkv[:, (heads + kv_heads) * d :].view(4, kv_heads, d))


@pytest.mark.parametrize("kind", ["sdpa", "sdpa-expanded"] if DEVICE == "cpu" else
                         ["sdpa", "sdpa-cudnn", "sdpa-flash", "flash-varlen", "sdpa-cudnn-expanded", "sdpa-efficient"])
def test_local_attention_is_causal_over_each_sequences_own_keys(kind):
    """Fresh prompts packed in one batch, each attending only over its own keys (grouped heads), by every kind
    of local attention the runner may pick (on CPU the SDPA paths; on CUDA every backend, bf16)."""
    from kvbaton.backend.compute.cuda.ops import local_attention

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    lengths, tables = [23, 40], [[1, 3], [0, 2, 4]]
    batch, q, k_cache, v_cache = random_prefill(gen, tables, [0, 0], lengths, 8, 2, 64, 16, 5, dtype, DEVICE)
    slots = batch.kv_slots.long()
    k, v = k_cache[:, slots].transpose(0, 1), v_cache[:, slots].transpose(0, 1)
    batch.local, batch.q_bounds = True, (0, 23, 63)
    want = TorchOps().prefill(q.float(), k_cache.float(), v_cache.float(), batch, 0.125)
    try:
        got = local_attention(kind, q, k, v, batch, 0.125)
    except RuntimeError as exc:  # a backend this GPU or build lacks: the runner's start-up check skips it too
        pytest.skip(f"{kind}: {exc}")
    assert got.shape == q.shape and _relative(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 64])
def test_add_rms_norm_is_the_residual_add_then_the_models_rmsnorm(dtype, hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen)
    norm = norm.to(dtype).to(DEVICE).requires_grad_(False)
    residual = torch.randn(5, hidden, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(5, hidden, generator=gen).to(dtype).to(DEVICE)
    h, normed = kernels.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    if dtype == torch.float32 or not INTERPRETED:
        assert torch.equal(h, residual + x)
    else:  # the interpreter converts fp32 to bf16 by truncation where a GPU rounds to nearest: no bitwise match
        assert _relative(h, residual + x) < 1e-2
    want = norm(residual + x)
    assert normed.dtype == dtype and _relative(normed, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    alone, normed_alone = kernels.add_rms_norm(x, None, norm.weight, norm.variance_epsilon)
    assert alone is x and _relative(normed_alone, norm(x)) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_table_slots_follow_the_block_table():
    assert table_slots([4, 1], 6, 4).tolist() == [16, 17, 18, 19, 4, 5]
