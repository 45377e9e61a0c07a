"""The stages of :func:`~.step.step` that are not matrix products: Triton kernels on CUDA, plain torch anywhere.

- :class:`TritonOps` (CUDA): residual add + RMSNorm and rotary + K/V store fused (``kernels.add_rms_norm``,
  ``kernels.rope_store``; padding rows write nothing), decode by the split-K paged kernel
  (``kernels.decode_attention``), prefill in bf16/fp16: fresh prompts (a local batch) over the step's own K/V,
  never read back from the pool, by the fastest attention this torch has that passes a check against the
  reference at start-up (:data:`LOCAL_KINDS`, in order: SDPA's cuDNN backend, which is also what transformers'
  SDPA path gets on sm90, then SDPA's FlashAttention, FlashAttention-2 varlen, ...); chunks behind cached
  tokens by FlashAttention-2 varlen (``torch.ops.aten._flash_attention_forward``, PyTorch's own build:
  bottom-right causal per sequence, over each sequence's K/V gathered into one packed copy); fp32 and sparse
  positions by the Triton varlen kernel reading the pool.
- :class:`TorchOps`: the model's own norm modules, torch's rotary and indexed K/V writes, SDPA per sequence over
  its K/V read from the pool. It loops over sequences in Python (so it cannot be captured in a graph); it is
  the reference the kernels are tested against and what runs the step on CPU, where the CUDA runner's math
  is tested against the eager runner.

Nothing here imports Triton at import time: :func:`triton_missing` says whether it can be used.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

from .step import Norm, StepBatch, StepWeights, rotate

log = logging.getLogger(__name__)

# How a local prefill batch attends (TritonOps.prefill_local), fastest first where it applies; the first that passes the
# start-up check is used, or the one $KVBATON_CUDA_LOCAL_ATTENTION names (A/B runs; "none": the paths before it).
LOCAL_KINDS = ("sdpa-cudnn", "sdpa-flash", "flash-varlen", "sdpa-cudnn-expanded", "sdpa-efficient")
LOCAL_ENV = "KVBATON_CUDA_LOCAL_ATTENTION"

# The most splits of one sequence's context in the decode kernel, and the programs to aim for (about two
# waves of an H200's 132 multiprocessors): fewer sequences, more splits each.
MAX_SPLITS = 16
TARGET_PROGRAMS = 264


def triton_missing() -> str | None:
    """Why the Triton kernels cannot be used here (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def kernels() -> Any:
    """The Triton kernel module (imports Triton)."""
    from . import kernels as module

    return module


def decode_splits(sequences: int, kv_heads: int) -> int:
    """Splits per sequence for the decode kernel: a power of two, more when few sequences share the GPU."""
    splits = 1
    while splits < MAX_SPLITS and sequences * kv_heads * splits * 2 <= TARGET_PROGRAMS:
        splits *= 2
    return splits


def table_slots(table: list[int], length: int, block_size: int) -> torch.Tensor:
    """Pool slots of positions ``0..length-1`` of a sequence with block table ``table`` (CPU, int64)."""
    ids = torch.tensor(table[: -(-length // block_size)], dtype=torch.long)
    return (ids[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:length]


class TorchOps:
    """The reference: plain torch, any device, one SDPA call per sequence (see the module). ``local``: a local
    batch attends over the step's own K/V (the math :class:`TritonOps` runs there, tested on CPU)."""

    name = "torch"
    gathers = False

    def __init__(self, local: bool = False) -> None:
        self.local_prefill = local

    def add_norm(self, hidden: torch.Tensor, x: torch.Tensor | None, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        if x is not None:
            hidden = hidden + x
        return hidden, norm.module(hidden)

    def rope_store(self, qkv: torch.Tensor, w: StepWeights, batch: StepBatch, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
        tokens, heads, kv_heads, d = qkv.shape[0], w.heads, w.kv_heads, w.head_dim
        cos = w.cos.index_select(0, batch.positions)[:, None]  # [tokens, 1, head_dim]
        sin = w.sin.index_select(0, batch.positions)[:, None]
        qk = rotate(qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d), cos, sin)
        self.store(k_cache, v_cache, qk[:, heads:], qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d),
                   batch.slots)
        return qk[:, :heads]

    def rope_store_kv(self, qkv: torch.Tensor, w: StepWeights, batch: StepBatch, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, heads, kv_heads, d = qkv.shape[0], w.heads, w.kv_heads, w.head_dim
        cos = w.cos.index_select(0, batch.positions)[:, None]
        sin = w.sin.index_select(0, batch.positions)[:, None]
        qk = rotate(qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d), cos, sin)
        v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
        self.store(k_cache, v_cache, qk[:, heads:], v, batch.slots)
        return qk[:, :heads], qk[:, heads:], v

    def prefill_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch,
                      scale: float) -> torch.Tensor:
        return local_attention("sdpa", q, k, v, batch, scale)

    @staticmethod
    def store(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None:
        """Write ``key``/``value`` (``[tokens, kv_heads, head_dim]``) at ``slots`` (-1: no write)."""
        keep = slots >= 0
        where = slots[keep].long()
        k_cache[:, where] = key[keep].transpose(0, 1).to(k_cache.dtype)
        v_cache[:, where] = value[keep].transpose(0, 1).to(v_cache.dtype)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch,
               scale: float) -> torch.Tensor:
        out = torch.zeros_like(q)
        for b, length in enumerate(batch.context_lens.tolist()):
            if length:
                out[b] = self._attend(q[b : b + 1], k_cache, v_cache, batch, b, [length - 1], scale)[0]
        return out

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch,
                scale: float) -> torch.Tensor:
        assert batch.cu_q is not None
        out = torch.empty_like(q)
        bounds = batch.cu_q.tolist()
        positions = batch.positions.tolist()
        for s in range(len(bounds) - 1):
            a, b = bounds[s], bounds[s + 1]
            if b > a:
                out[a:b] = self._attend(q[a:b], k_cache, v_cache, batch, s, positions[a:b], scale)
        return out

    @staticmethod
    def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch, seq: int,
                positions: list[int], scale: float) -> torch.Tensor:
        """Rows ``q`` (``[n, heads, d]``) of sequence ``seq`` at ``positions``, each seeing keys up to its own."""
        length = positions[-1] + 1
        slots = table_slots(batch.block_tables[seq].tolist(), length, batch.block_size).to(k_cache.device)
        keys, values = k_cache.index_select(1, slots), v_cache.index_select(1, slots)
        pos = torch.tensor(positions, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                             scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)


class TritonOps:
    """The CUDA stages: Triton kernels, FlashAttention-class attention for bf16/fp16 prefill (see the module)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, flash: bool | None = None,
                 local: str | None = None) -> None:
        self._kernels = kernels()
        # FlashAttention-2 varlen for dense prefill: it reads each sequence's keys gathered (``StepBatch.kv_slots``).
        self.gathers = flash if flash is not None else flash_prefill_ok(dtype, device)
        # A local batch (fresh prompts): attention over the step's own K/V, by the kind chosen at start-up.
        self.local_kind = local if local is not None else local_attention_kind(dtype, device)
        self.local_prefill = self.local_kind is not None
        self.name = "triton" + (" + flash prefill" if self.gathers else "") + (
            f" + {self.local_kind} local prefill" if self.local_kind else "")

    def add_norm(self, hidden: torch.Tensor, x: torch.Tensor | None, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kernels.add_rms_norm(hidden, None, norm.weight, norm.eps) if x is None else \
            self._kernels.add_rms_norm(x, hidden, norm.weight, norm.eps)

    def rope_store(self, qkv: torch.Tensor, w: StepWeights, batch: StepBatch, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
        return self._kernels.rope_store(qkv, w.cos, w.sin, batch.positions, batch.slots, k_cache, v_cache, w.heads,
                                        w.kv_heads)

    def rope_store_kv(self, qkv: torch.Tensor, w: StepWeights, batch: StepBatch, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, d = qkv.shape[0], w.head_dim
        k = torch.empty((tokens, w.kv_heads, d), dtype=qkv.dtype, device=qkv.device)
        q = self._kernels.rope_store(qkv, w.cos, w.sin, batch.positions, batch.slots, k_cache, v_cache, w.heads,
                                     w.kv_heads, k_out=k)
        return q, k, qkv[:, (w.heads + w.kv_heads) * d :].view(tokens, w.kv_heads, d)

    def prefill_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch,
                      scale: float) -> torch.Tensor:
        assert self.local_kind is not None
        return local_attention(self.local_kind, q, k, v, batch, scale)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch,
               scale: float) -> torch.Tensor:
        splits = decode_splits(q.shape[0], k_cache.shape[0])
        return self._kernels.decode_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                              batch.block_size, scale, splits)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch,
                scale: float) -> torch.Tensor:
        assert batch.cu_q is not None
        if self.gathers and batch.dense and batch.kv_slots is not None:
            return flash_varlen(q, k_cache, v_cache, batch, scale)
        return self._kernels.prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_q, batch.positions,
                                               batch.max_q, batch.block_size, scale)


def flash_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch,
                 scale: float) -> torch.Tensor:
    """FlashAttention-2 varlen over each sequence's keys gathered from the pool (bottom-right causal: query ``i``
    of a sequence with ``n`` queries and ``m`` keys sees keys ``0..m-n+i``, i.e. up to its own position)."""
    assert batch.kv_slots is not None and batch.cu_k is not None and batch.cu_q is not None
    keys = k_cache.index_select(1, batch.kv_slots).transpose(0, 1).contiguous()  # [keys, kv_heads, d]
    values = v_cache.index_select(1, batch.kv_slots).transpose(0, 1).contiguous()
    return torch.ops.aten._flash_attention_forward(
        q, keys, values, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k, 0.0, True, False, scale=scale)[0]


def local_attention(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch,
                    scale: float) -> torch.Tensor:
    """Causal attention of a local batch's packed sequences (rows ``q_bounds[s]..q_bounds[s+1]-1``) over their own
    keys: ``q`` ``[tokens, heads, d]``, ``k``/``v`` ``[tokens, kv_heads, d]`` (row strides free). ``kind``:
    ``flash-varlen`` (one FlashAttention-2 varlen call), ``sdpa`` (SDPA, torch's choice of backend), or one SDPA
    backend (``sdpa-cudnn``, ``sdpa-flash``, ``sdpa-efficient``): grouped heads natively, or with ``-expanded``
    (``sdpa-cudnn-expanded``, ``sdpa-expanded``) K/V repeated per query head first, as transformers' SDPA path
    does where grouped heads are not supported."""
    if kind == "flash-varlen":
        assert batch.cu_q is not None
        return torch.ops.aten._flash_attention_forward(
            q, k, v, batch.cu_q, batch.cu_q, batch.max_q, batch.max_q, 0.0, True, False, scale=scale)[0]
    parts = kind.split("-")  # sdpa[-backend][-expanded]
    expanded = parts[-1] == "expanded"
    backend = parts[1] if len(parts) > 1 and parts[1] != "expanded" else ""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = batch.q_bounds
    with _sdpa_backend(backend):
        for a, b in itertools.pairwise(bounds):
            qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            if expanded:
                ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
            out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                      enable_gqa=not expanded and group > 1)[0].transpose(0, 1)
    return out


def _sdpa_backend(name: str) -> Any:
    """SDPA restricted to one backend (``""``: torch's own choice)."""
    import contextlib

    if not name:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]])


_LOCAL_CHECKED: dict[tuple[torch.dtype, str], str | None] = {}


def local_attention_kind(dtype: torch.dtype, device: torch.device) -> str | None:
    """The first of :data:`LOCAL_KINDS` (or the one ``$KVBATON_CUDA_LOCAL_ATTENTION`` names; ``none``: no local
    path) that runs here for ``dtype`` and agrees with the reference on a small random batch (two fresh
    sequences, grouped heads): checked once per dtype and device. None on CPU and in fp32 (where prefill keeps
    the Triton kernel, bit-for-bit the path the exactness checks cover)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    key = (dtype, str(device))
    if key not in _LOCAL_CHECKED:
        forced = os.environ.get(LOCAL_ENV)
        kinds = () if forced == "none" else (forced,) if forced else LOCAL_KINDS
        _LOCAL_CHECKED[key] = next((kind for kind in kinds if _check_local(kind, dtype, device)), None)
        log.info("local prefill attention in %s: %s", dtype, _LOCAL_CHECKED[key] or "none (pool-reading kernels)")
    return _LOCAL_CHECKED[key]


def fused_qkv(gen: torch.Generator, tokens: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype,
              device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v laid out as the step hands them to ``prefill_local``: q and k contiguous (the rotary
    kernel's outputs), v a strided view of the fused projection."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype).to(device)
    q = qkv[:, : heads * d].reshape(tokens, heads, d).contiguous()
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(tokens, kv_heads, d).contiguous()
    return q, k, qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)


def _check_local(kind: str, dtype: torch.dtype, device: torch.device) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(1)
    heads, kv_heads, d, lengths = 8, 2, 64, (37, 64)
    tokens = sum(lengths)
    q, k, v = fused_qkv(gen, tokens, heads, kv_heads, d, dtype, device)
    bounds = (0, lengths[0], tokens)
    ints = {"dtype": torch.int32, "device": device}
    batch = StepBatch(input_ids=torch.zeros(tokens, **ints), positions=torch.zeros(tokens, **ints),
                      slots=torch.zeros(tokens, **ints), block_tables=torch.zeros(2, 1, **ints),
                      context_lens=torch.tensor(lengths, **ints), block_size=16, cu_q=torch.tensor(bounds, **ints),
                      max_q=max(lengths), local=True, q_bounds=bounds)
    try:
        got = local_attention(kind, q, k, v, batch, d**-0.5).float()
        want = local_attention("sdpa", q.float().cpu(), k.float().cpu(), v.float().cpu(), batch, d**-0.5)
        error = float((got.cpu() - want).norm() / want.norm())
    except Exception as exc:  # noqa: BLE001 - a backend this build or GPU lacks: the next kind
        log.info("local prefill attention %s unavailable in %s: %s", kind, dtype, exc)
        return False
    if error >= 2e-2:
        log.info("local prefill attention %s disagrees with the reference in %s (relative error %.1e)", kind, dtype,
                 error)
    return error < 2e-2


_FLASH_CHECKED: dict[tuple[torch.dtype, str], bool] = {}


def flash_prefill_ok(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether FlashAttention-2 varlen runs here for ``dtype`` with the semantics :func:`flash_varlen` needs:
    checked once per dtype and device against :class:`TorchOps` on a small random batch (two sequences,
    one behind cached keys, grouped heads); any failure or mismatch leaves prefill on the Triton kernel."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    key = (dtype, str(device))
    if key not in _FLASH_CHECKED:
        try:
            _FLASH_CHECKED[key] = _check_flash(dtype, device)
        except Exception as exc:  # noqa: BLE001 - an op missing from this build, an unsupported GPU
            log.info("FlashAttention varlen unavailable (%s): prefill uses the Triton kernel", exc)
            _FLASH_CHECKED[key] = False
        if not _FLASH_CHECKED[key]:
            log.info("FlashAttention varlen disagrees with the reference: prefill uses the Triton kernel")
    return _FLASH_CHECKED[key]


def _check_flash(dtype: torch.dtype, device: torch.device) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    kv_heads, heads, d, block_size = 2, 8, 64, 16
    cached, fresh = [40, 0], [24, 33]
    tables = [[3, 0, 5, 1, 7], [2, 6, 4]]
    batch, q, k_cache, v_cache = random_prefill(gen, tables, cached, fresh, heads, kv_heads, d, block_size, 8,
                                                dtype, device)
    got = flash_varlen(q, k_cache, v_cache, batch, d**-0.5).float()
    want = TorchOps().prefill(q.float(), k_cache.float(), v_cache.float(), batch, d**-0.5)
    return bool(((got - want).norm() / want.norm()).item() < 2e-2)


def random_prefill(gen: torch.Generator, tables: list[list[int]], cached: list[int], fresh: list[int], heads: int,
                   kv_heads: int, head_dim: int, block_size: int, num_blocks: int, dtype: torch.dtype,
                   device: torch.device | str) -> tuple[StepBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill batch over a random pool layer: sequence ``s`` has ``cached[s]`` keys in the pool and
    ``fresh[s]`` new queries after them (their K/V in the pool too). For kernel checks (tests, start-up)."""
    slots = num_blocks * block_size
    k_cache = torch.randn(kv_heads, slots, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(kv_heads, slots, head_dim, generator=gen).to(dtype).to(device)
    q = torch.randn(sum(fresh), heads, head_dim, generator=gen).to(dtype).to(device)
    width = max(len(t) for t in tables)
    positions = [p for c, n in zip(cached, fresh) for p in range(c, c + n)]
    kv_slots = torch.cat([table_slots(t, c + n, block_size) for t, c, n in zip(tables, cached, fresh)])
    cu_q = [0]
    cu_k = [0]
    for c, n in zip(cached, fresh):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + c + n)
    ints = {"dtype": torch.int32, "device": device}
    batch = StepBatch(
        input_ids=torch.zeros(len(positions), **ints), positions=torch.tensor(positions, **ints),
        slots=torch.full((len(positions),), -1, **ints),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **ints),
        context_lens=torch.tensor([c + n for c, n in zip(cached, fresh)], **ints), block_size=block_size,
        cu_q=torch.tensor(cu_q, **ints), max_q=max(fresh), logit_rows=None, dense=True,
        kv_slots=kv_slots.to(device=device, dtype=torch.int32), cu_k=torch.tensor(cu_k, **ints),
        max_k=max(c + n for c, n in zip(cached, fresh)))
    return batch, q, k_cache, v_cache
