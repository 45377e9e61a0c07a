"""Paged attention plugged into the Hugging Face model definition.

The engine runs the unmodified transformers model with ``attn_implementation="kvbaton_paged"``.
For every layer, the function below writes the new tokens' (already rotated) K/V into the block
pool and attends over the sequence's blocks. Several sequences can be packed into one forward
(varlen batch: their tokens are concatenated along the sequence axis), which is how prefill
chunks and decode steps of different requests share one pass through the weights.

How it attends is the :class:`AttentionBackend` the runner was built with (chosen for the device in
:mod:`.selector`): PyTorch's SDPA over the pool everywhere, with a fused kernel over the pool where the
device has one (CPU fp32: kvbaton's causal flash kernel, ``cpu/prefill.py``) and, on CPU, a chunk behind
cached tokens split into an unmasked and a causal part. This module knows no device.

What the model's attention is comes from the registry (``kvbaton.backend.models``), through the batch: each
layer's sliding window and the scores' soft-cap (Gemma 2). A window shorter than the context, or soft-capped
scores, go to the fused kernel when it takes them (CPU: kvbaton's), else to the generic path below (SDPA with
the window's mask, or transformers' soft-capped formula): never the plain causal path, which would be wrong.

Called without kvbaton metadata (plain ``model(input_ids)``), it is ordinary SDPA attention (with the
window and soft-cap transformers' module asks for).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from ..cache.block_pool import BlockPool

ATTN_IMPLEMENTATION = "kvbaton_paged"
BATCH_KWARG = "kvbaton_batch"


@dataclass
class SeqAttention:
    """Where one packed sequence's queries are, and where its K/V go and come from."""

    q_start: int  # offset of its new tokens in the packed batch
    q_len: int
    write_slots: torch.Tensor | slice  # pool slots of the new tokens
    read_slots: torch.Tensor | slice  # pool slots of all tokens it attends to (context + new)
    mask: torch.Tensor | None  # [q_len, kv_len] bool, None when plain causal or single query
    causal: bool  # new tokens are the whole sequence: SDPA's causal flag is exact
    prefix: int = 0  # split attention (CPU): cached tokens seen unmasked, then causal over the new ones
    # Explicit ascending positions of the new tokens among ``read_slots`` (selective recomputation); ``mask``
    # says the same for SDPA, the fused kernel takes these instead.
    positions: torch.Tensor | None = None


# A kernel over the pool: (query [heads, q_len, d], pool, layer, read slots, scale, explicit positions or None,
# sliding window or 0, soft-cap or 0) -> [1, heads, q_len, d], or None when it does not apply to these inputs
# (the generic path runs instead).
PoolAttention = Callable[
    [torch.Tensor, BlockPool, int, torch.Tensor | slice, float | None, torch.Tensor | None, int, float],
    torch.Tensor | None,
]


@dataclass(frozen=True)
class AttentionBackend:
    """How paged attention runs on one device (chosen by :mod:`.selector`)."""

    name: str
    # Tried first for chunks that need no dense mask (causal from 0, one query, split, explicit positions).
    fused: PoolAttention | None = None
    # A chunk behind cached tokens as two unmasked flash calls merged by log-sum-exp (:func:`_prefix_then_causal`,
    # CPU: PyTorch's CPU flash attention is fastest without a mask); otherwise SDPA with a causal mask.
    split_prefix: bool = False


SDPA = AttentionBackend("sdpa")


@dataclass
class AttentionBatch:
    pool: BlockPool
    seqs: list[SeqAttention]
    backend: AttentionBackend = SDPA
    # The model's attention (``Architecture``): each layer's sliding window (None: the whole context) and the
    # scores' soft-cap. Both come from the registry, never from what a transformers module passes along.
    windows: Sequence[int | None] | None = None
    softcap: float | None = None


def build_seq_attention(
    pool: BlockPool, blocks: list[int], q_start: int, start: int, q_len: int, split_prefix: bool = False
) -> SeqAttention:
    """Metadata for a sequence that has ``start`` cached tokens and ``q_len`` new ones (``split_prefix``: see
    :class:`AttentionBackend`)."""
    end = start + q_len
    mask = None
    behind_cache = start > 0 and q_len > 1
    split = behind_cache and split_prefix
    if behind_cache and not split:
        # Query i (absolute position start+i) sees keys 0..start+i: bottom-right aligned causal mask.
        q_pos = torch.arange(start, end, device=pool.device)[:, None]
        mask = torch.arange(end, device=pool.device)[None, :] <= q_pos
    return SeqAttention(
        q_start=q_start,
        q_len=q_len,
        write_slots=pool.slots(blocks, start, end),
        read_slots=pool.slots(blocks, 0, end),
        mask=mask,
        causal=start == 0 and q_len > 1,
        prefix=start if split else 0,
    )


def build_sparse_attention(pool: BlockPool, blocks: list[int], q_start: int, positions: Sequence[int]) -> SeqAttention:
    """Metadata for new tokens at explicit ascending ``positions`` among cached ones (selective
    recomputation): each writes its K/V at its own slot and sees every position up to its own."""
    end = positions[-1] + 1
    pos = torch.tensor(list(positions), dtype=torch.long, device=pool.device)
    read = pool.slots(blocks, 0, end)
    write = pos + read.start if isinstance(read, slice) else read[pos]
    return SeqAttention(
        q_start=q_start,
        q_len=len(positions),
        write_slots=write,
        read_slots=read,
        mask=torch.arange(end, device=pool.device)[None, :] <= pos[:, None],
        causal=False,
        positions=pos,
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    batch: AttentionBatch | None = kwargs.get(BATCH_KWARG)
    if batch is None:
        if query.shape[2] not in (1, key.shape[2]):
            # Our mask hook returns None, which is only right for these two shapes.
            raise RuntimeError(f"{ATTN_IMPLEMENTATION} without kvbaton metadata needs a full or one-token forward")
        softcap, window = kwargs.pop("softcap", None), kwargs.pop("sliding_window", None)
        if softcap or window:  # what transformers' module asks for, which SDPA's causal flag cannot give
            n, m = query.shape[2], key.shape[2]
            q_pos, k_pos = torch.arange(m - n, m, device=query.device)[:, None], torch.arange(m, device=query.device)
            mask = k_pos <= q_pos
            if window:
                mask &= k_pos > q_pos - window
            out = softcapped_attention(query, key[0], value[0], mask, scaling, softcap) if softcap else \
                F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    layer = module.layer_idx
    pool = batch.pool
    kernel = batch.backend.fused
    window = batch.windows[layer] if batch.windows is not None else None
    softcap = batch.softcap
    outputs = []
    for seq in batch.seqs:
        q_end = seq.q_start + seq.q_len
        # query/key/value: [1, heads, packed_tokens, head_dim]; the model has already applied RoPE.
        pool.write(layer, seq.write_slots, key[0, :, seq.q_start : q_end], value[0, :, seq.q_start : q_end])
        kv_len = _length(seq.read_slots)
        bounded = (window is not None and kv_len > window) or softcap is not None
        if kernel is not None and (bounded or seq.mask is None or seq.positions is not None) and (fused := kernel(
                query[0, :, seq.q_start : q_end], pool, layer, seq.read_slots, scaling, seq.positions,
                window if bounded and window is not None else 0, softcap or 0.0)) is not None:
            outputs.append(fused)  # a kernel over the pool (CPU, fp32: kvbaton's): no read, no split, no mask
            continue
        if bounded:  # a window shorter than the context, or soft-capped scores: the generic path
            outputs.append(_bounded(query[:, :, seq.q_start : q_end], pool, layer, seq, kv_len, scaling,
                                    window if window is not None and kv_len > window else None, softcap))
            continue
        k, v = pool.read(layer, seq.read_slots)
        if seq.prefix:
            outputs.append(_prefix_then_causal(query[:, :, seq.q_start : q_end], k, v, seq.prefix, scaling))
            continue
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, seq.q_start : q_end],
                k.unsqueeze(0),
                v.unsqueeze(0),
                attn_mask=seq.mask,
                is_causal=seq.causal,
                scale=scaling,
                enable_gqa=True,
            )
        )
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _length(slots: torch.Tensor | slice) -> int:
    return slots.stop - slots.start if isinstance(slots, slice) else int(slots.numel())


def _part(slots: torch.Tensor | slice, lo: int, hi: int) -> torch.Tensor | slice:
    return slice(slots.start + lo, slots.start + hi) if isinstance(slots, slice) else slots[lo:hi]


# Queries per pass of the generic path: bounds its score matrix (heads x 256 x keys) for long prompts.
_QUERY_BLOCK = 256


def _bounded(query: torch.Tensor, pool: BlockPool, layer: int, seq: SeqAttention, kv_len: int,
             scaling: float | None, window: int | None, softcap: float | None) -> torch.Tensor:
    """Attention of one sequence's queries ``[1, heads, q_len, d]`` where a sliding window or soft-capped scores
    rule out the plain causal path: query at position p sees keys ``max(0, p - window + 1)..p`` (transformers'
    sliding window: itself and the window - 1 before it), its scores ``cap * tanh(s / cap)`` when soft-capped
    (transformers' eager formula). Blocks of queries read only the keys some query of the block sees."""
    q_len = seq.q_len
    device = query.device
    positions = seq.positions if seq.positions is not None else torch.arange(kv_len - q_len, kv_len, device=device)
    outs = []
    for b0 in range(0, q_len, _QUERY_BLOCK):
        qp = positions[b0 : b0 + _QUERY_BLOCK]
        if seq.positions is None:  # consecutive: known without reading the device
            first, last = kv_len - q_len + b0, kv_len - q_len + b0 + qp.numel() - 1
        else:
            first, last = int(qp[0]), int(qp[-1])
        lo = max(0, first - window + 1) if window is not None else 0
        k, v = pool.read(layer, _part(seq.read_slots, lo, last + 1))
        kp = torch.arange(lo, last + 1, device=device)[None, :]
        mask = kp <= qp[:, None]
        if window is not None:
            mask &= kp > qp[:, None] - window
        q = query[:, :, b0 : b0 + _QUERY_BLOCK]
        if softcap is None:
            outs.append(F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=mask, scale=scaling,
                                                       enable_gqa=True))
        else:
            outs.append(softcapped_attention(q, k, v, mask, scaling, softcap))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def softcapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                         scaling: float | None, softcap: float) -> torch.Tensor:
    """``query [1, heads, n, d]`` over ``key/value [kv_heads, m, d]`` with ``mask [n, m]`` (True: seen), scores
    soft-capped, in transformers' eager order: ``s * scale``, ``/ cap``, ``tanh``, ``* cap``, mask, fp32 softmax."""
    heads, d = query.shape[1], query.shape[-1]
    group = heads // key.shape[0]
    k = key.repeat_interleave(group, dim=0)[None] if group > 1 else key[None]
    v = value.repeat_interleave(group, dim=0)[None] if group > 1 else value[None]
    scores = torch.matmul(query, k.transpose(2, 3)) * (scaling if scaling is not None else d**-0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, v)


def _prefix_then_causal(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: int, scaling: float | None
) -> torch.Tensor:
    """Attention of a later prefill chunk on CPU, without a mask.

    PyTorch's CPU flash attention is fastest with no mask or with its causal flag, and a chunk
    behind cached tokens needs neither: its queries see every cached key (no mask) and the
    chunk's own keys causally (the flag, top-left aligned because that part is square). Both
    parts return their log-sum-exp, which merges them exactly as one softmax over all keys.
    query: ``[1, heads, q_len, d]``; key/value: ``[kv_heads, prefix + q_len, d]``.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _, heads, q_len, d = query.shape
    kv_heads = key.shape[0]
    group = heads // kv_heads
    # Cached part: fold each GQA group into the query axis, so every K/V row is read once per
    # group rather than copied ``group`` times (query head h uses K/V head h // group).
    folded = query.reshape(1, kv_heads, group * q_len, d)
    out_p, lse_p = flash(folded, key[None, :, :prefix], value[None, :, :prefix], 0.0, False, scale=scaling)[:2]
    own_k = key[:, prefix:].repeat_interleave(group, dim=0)[None]
    own_v = value[:, prefix:].repeat_interleave(group, dim=0)[None]
    out_c, lse_c = flash(query, own_k, own_v, 0.0, True, scale=scaling)[:2]
    lse_p = lse_p.reshape(1, heads, q_len)
    top = torch.maximum(lse_p, lse_c)
    w_p, w_c = torch.exp(lse_p - top), torch.exp(lse_c - top)
    total = (w_p + w_c).unsqueeze(-1)
    merged = out_p.reshape(1, heads, q_len, d).float() * (w_p.unsqueeze(-1) / total)
    merged += out_c.float() * (w_c.unsqueeze(-1) / total)
    return merged.to(query.dtype)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # Masks are built per sequence above; skip transformers' dense mask construction.
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
