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

Called without kvbaton metadata (plain ``model(input_ids)``), it is ordinary SDPA attention.
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


# A kernel over the pool: (query [heads, q_len, d], pool, layer, read slots, scale, explicit positions or None)
# -> [1, heads, q_len, d], or None when it does not apply to these inputs (SDPA runs instead).
PoolAttention = Callable[
    [torch.Tensor, BlockPool, int, torch.Tensor | slice, float | None, torch.Tensor | None], torch.Tensor | None
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
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    layer = module.layer_idx
    pool = batch.pool
    kernel = batch.backend.fused
    outputs = []
    for seq in batch.seqs:
        q_end = seq.q_start + seq.q_len
        # query/key/value: [1, heads, packed_tokens, head_dim]; the model has already applied RoPE.
        pool.write(layer, seq.write_slots, key[0, :, seq.q_start : q_end], value[0, :, seq.q_start : q_end])
        if kernel is not None and (seq.mask is None or seq.positions is not None) and (fused := kernel(
                query[0, :, seq.q_start : q_end], pool, layer, seq.read_slots, scaling, seq.positions)) is not None:
            outputs.append(fused)  # a kernel over the pool (CPU, fp32: kvbaton's): no read, no split, no mask
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
