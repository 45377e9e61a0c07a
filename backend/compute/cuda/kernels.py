"""The CUDA runner's Triton kernels: the fused elementwise stages of a decoder layer, paged decode attention
(split-K) and varlen prefill attention, the attention kernels reading and writing the block pool in place.

The pool's layout (:mod:`~kvbaton.backend.cache.block_pool`): one layer's K (and V) is ``[kv_heads, slots,
head_dim]``, and token ``n`` of a sequence with block table ``t`` lives in slot ``t[n // block_size] *
block_size + n % block_size``. The kernels take that layer view, a block table per sequence and lengths, so a
sequence's K/V are never gathered into a contiguous copy.

- :func:`add_rms_norm`: the residual add and the next RMSNorm in one pass (the Hugging Face RMSNorm: fp32
  statistics, normalised value cast to the model's dtype, then times the weight), and
- :func:`rope_store`: rotary embedding of the q and k heads of a fused qkv projection, the rotated q to a
  buffer, the rotated k and the v written into the pool at each token's slot; a slot of -1 is a padding row
  (a CUDA graph's bucket padded past the real batch) and writes nothing. Together they replace about twenty
  small kernels per layer of the module-by-module forward, which at batch 1 are what a decode step waits on.
  In bf16/fp16 they round where torch's elementwise ops round (each product, each sum), so the values are
  torch's.
- :func:`decode_attention`: one query token per sequence. A program takes one (sequence, KV head, split):
  the query heads of that KV head's group ride together as the rows of one ``tl.dot``, so each K/V row is
  loaded once per group, and the context is cut into ``splits`` parts (split-K, flash-decoding) so that a
  batch of one long sequence still fills the GPU. Each split writes its partial output and log-sum-exp; a
  second kernel merges them exactly. Every size is fixed by the launch, never by the data (context lengths
  are read on the device), so a launch can be captured in a CUDA graph once and replayed for any lengths.
- :func:`prefill_attention`: packed chunks of several sequences (varlen), each query at an explicit position
  (ascending within its sequence) seeing every key up to its position: a fresh prompt, a chunk behind cached
  tokens and a sparse recomputation alike. Flash-attention style online softmax over key tiles.

fp32 inputs use ``input_precision="ieee"`` for every ``tl.dot`` (:func:`_dot`). Written against Triton 3.6 (the
GPU machine's), using nothing newer. Importing this module needs Triton; :mod:`.ops` imports it only where
Triton is installed.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (TRITON_INTERPRET=1: the kernels on CPU tensors, in tests) multiplies bf16 wrongly in
# tl.dot: there every product is taken in fp32 from the (exactly) upcast operands instead.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _exact(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or _INTERPRETED


@triton.jit
def _dot(a, b, EXACT: tl.constexpr):
    """``a @ b`` accumulated in fp32; ``EXACT``: fp32 products of the upcast operands (``ieee``: Triton's fp32
    default is tf32, which would not be token-identical to the eager runner)."""
    if EXACT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def _add_rms_norm_kernel(x, residual, weight, out_residual, out_normed, eps, stride_x, stride_r, stride_or,
                         stride_on, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < N
    h = tl.load(x + row * stride_x + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # torch: residual + x in the model's dtype
        r = tl.load(residual + row * stride_r + c, mask=mask, other=0.0)
        h = (r.to(tl.float32) + h.to(tl.float32)).to(out_residual.dtype.element_ty)
        tl.store(out_residual + row * stride_or + c, h, mask=mask)
    hf = h.to(tl.float32)
    variance = tl.sum(hf * hf, 0) / N
    normed = (hf * tl.math.rsqrt(variance + eps)).to(out_normed.dtype.element_ty)
    w = tl.load(weight + c, mask=mask, other=0.0)
    tl.store(out_normed + row * stride_on + c, (w.to(tl.float32) * normed.to(tl.float32)).to(
        out_normed.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h) * weight)`` with ``h = residual + x`` (``h = x`` without a residual); ``[tokens, hidden]``."""
    tokens, hidden = x.shape
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    out_residual = x if residual is None else torch.empty_like(x)
    normed = torch.empty_like(x)
    source = x if residual is None else residual
    _add_rms_norm_kernel[(tokens,)](
        x, source, weight, out_residual, normed, eps, x.stride(0), source.stride(0), out_residual.stride(0),
        normed.stride(0), N=hidden, BLOCK=_pow2(hidden, 16), HAS_RESIDUAL=residual is not None,
        num_warps=4 if hidden <= 2048 else 8)
    return out_residual, normed


@triton.jit
def _rope_half(a, b, c, s, SIGN: tl.constexpr):
    """One half of ``x * cos + rotate_half(x) * sin`` with torch's roundings: ``a * c + SIGN * b * s``, ``b``
    being the other half; each product and the sum rounded to ``x``'s dtype (the sign applied in fp32, exactly)."""
    dtype = a.dtype
    first = (a.to(tl.float32) * c.to(tl.float32)).to(dtype)
    second = (SIGN * (b.to(tl.float32) * s.to(tl.float32))).to(dtype)
    return (first.to(tl.float32) + second.to(tl.float32)).to(dtype)


@triton.jit
def _rope_store_kernel(qkv, cos, sin, positions, slots, q_out, k_cache, v_cache, k_out, stride_t, stride_qt, stride_qh,
                       stride_ch, stride_cs, stride_cos, stride_kt, stride_kh, HEADS: tl.constexpr,
                       KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_KV: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, K_OUT: tl.constexpr):
    # One program per token: every q and k head as the rows of one tile, then every v head.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    c1 = tl.load(cos + pos * stride_cos + i, mask=i_mask)[None, :]
    c2 = tl.load(cos + pos * stride_cos + HALF + i, mask=i_mask)[None, :]
    s1 = tl.load(sin + pos * stride_cos + i, mask=i_mask)[None, :]
    s2 = tl.load(sin + pos * stride_cos + HALF + i, mask=i_mask)[None, :]
    heads = tl.arange(0, BLOCK_HEADS)
    mask = (heads < HEADS + KV_HEADS)[:, None] & i_mask[None, :]
    src = qkv + t * stride_t + heads[:, None] * (2 * HALF) + i[None, :]
    x1 = tl.load(src, mask=mask)
    x2 = tl.load(src + HALF, mask=mask)
    out1 = _rope_half(x1, x2, c1, s1, -1.0)
    out2 = _rope_half(x2, x1, c2, s2, 1.0)
    is_q = (heads < HEADS)[:, None] & mask
    q_dst = q_out + t * stride_qt + heads[:, None] * stride_qh + i[None, :]
    tl.store(q_dst, out1, mask=is_q)
    tl.store(q_dst + HALF, out2, mask=is_q)
    # k rows: heads HEADS.. are k heads 0..; a padding row (slot -1) writes nothing
    written = (heads[:, None] * 0 + slot) >= 0
    is_k = (heads >= HEADS)[:, None] & mask & written
    k_dst = k_cache + (heads[:, None] - HEADS).to(tl.int64) * stride_ch + slot * stride_cs + i[None, :]
    tl.store(k_dst, out1.to(k_cache.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, out2.to(k_cache.dtype.element_ty), mask=is_k)
    if K_OUT:  # the rotated k also to a buffer: prefill attends over this step's own keys without reading the pool
        k_rows = (heads >= HEADS)[:, None] & mask
        k_buf = k_out + t * stride_kt + (heads[:, None] - HEADS).to(tl.int64) * stride_kh + i[None, :]
        tl.store(k_buf, out1, mask=k_rows)
        tl.store(k_buf + HALF, out2, mask=k_rows)
    kv = tl.arange(0, BLOCK_KV)
    v_mask = (kv < KV_HEADS)[:, None] & i_mask[None, :] & ((kv[:, None] * 0 + slot) >= 0)
    v_src = qkv + t * stride_t + (HEADS + KV_HEADS + kv[:, None]) * (2 * HALF) + i[None, :]
    v_dst = v_cache + kv[:, None].to(tl.int64) * stride_ch + slot * stride_cs + i[None, :]
    tl.store(v_dst, tl.load(v_src, mask=v_mask).to(v_cache.dtype.element_ty), mask=v_mask)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=v_mask).to(v_cache.dtype.element_ty), mask=v_mask)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
               k_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate the q and k heads of ``qkv`` (``[tokens, (heads + 2 * kv_heads) * head_dim]``: q, k, v heads in
    order) by ``cos``/``sin`` (``[positions, head_dim]``) at ``positions``; write the rotated k and the v into
    one layer of the pool (``[kv_heads, slots, head_dim]``) at ``slots`` (-1: no write), and the rotated k into
    ``k_out`` (``[tokens, kv_heads, head_dim]``) when given; return the rotated q, ``[tokens, heads, head_dim]``."""
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and head_dim % 2 == 0
    q = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    assert k_out is None or (k_out.shape == (tokens, kv_heads, head_dim) and k_out.stride(-1) == 1)
    _rope_store_kernel[(tokens,)](
        qkv, cos, sin, positions, slots, q, k_cache, v_cache, q if k_out is None else k_out, qkv.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), cos.stride(0),
        0 if k_out is None else k_out.stride(0), 0 if k_out is None else k_out.stride(1), HEADS=heads,
        KV_HEADS=kv_heads, HALF=head_dim // 2, BLOCK_HEADS=_pow2(heads + kv_heads, 1), BLOCK_KV=_pow2(kv_heads, 1),
        BLOCK_HALF=_pow2(head_dim // 2, 1), K_OUT=k_out is not None, num_warps=4)
    return q


@triton.jit
def _kv_tile(table, n0, end, page_size, k_base, v_base, stride_cs, d, d_mask, BLOCK_N: tl.constexpr):
    """Token indices ``n0..n0+BLOCK_N-1`` of a sequence, which of them are below ``end``, and their keys and
    values read in place through the block table ``table`` (0 past ``end``)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < end
    page = tl.load(table + n // page_size, mask=n_mask, other=0).to(tl.int64)
    slot = page * page_size + n % page_size
    kv_mask = n_mask[:, None] & d_mask[None, :]
    keys = tl.load(k_base + slot[:, None] * stride_cs + d[None, :], mask=kv_mask, other=0.0)
    values = tl.load(v_base + slot[:, None] * stride_cs + d[None, :], mask=kv_mask, other=0.0)
    return n, n_mask, keys, values


@triton.jit
def _softmax_tile(scores, values, m, denom, acc, EXACT: tl.constexpr):
    """One key tile of the online softmax (flash attention): ``scores`` (-inf where a key is hidden) update
    the running row maximum ``m``, sum ``denom`` and unnormalised output ``acc``."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    # A row with no visible key yet (a padding row) keeps m = -inf: shift by 0 so it stays at 0, not nan.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - shift)
    p = tl.exp(scores - shift[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(values.dtype), values, EXACT)
    return m_new, denom, acc


@triton.jit
def _decode_partial_kernel(q, k_cache, v_cache, block_tables, context_lens, mid_o, mid_lse, scale, page_size,
                           stride_qb, stride_qh, stride_ch, stride_cs, stride_bt, stride_ob, stride_oh, stride_os,
                           stride_lb, stride_lh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                           SPLITS: tl.constexpr, EXACT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    ctx = tl.load(context_lens + b)
    per_split = tl.cdiv(ctx, SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    rows = tl.arange(0, BLOCK_H)
    row_mask = rows < GROUP
    heads = kvh * GROUP + rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    query = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = k_cache + kvh * stride_ch
    v_base = v_cache + kvh * stride_ch
    table = block_tables + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        _, n_mask, keys, values = _kv_tile(table, n0, end, page_size, k_base, v_base, stride_cs, d, d_mask, BLOCK_N)
        scores = tl.where(n_mask[None, :], _dot(query, tl.trans(keys), EXACT) * scale, float("-inf"))
        m, denom, acc = _softmax_tile(scores, values, m, denom, acc, EXACT)
    filled = denom > 0
    safe = tl.where(filled, denom, 1.0)
    out = acc / safe[:, None]
    lse = tl.where(filled, m + tl.log(safe), float("-inf"))  # an empty split weighs nothing in the merge
    tl.store(mid_o + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
             mask=row_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse + b * stride_lb + heads * stride_lh + split, lse, mask=row_mask)


@triton.jit
def _decode_merge_kernel(mid_o, mid_lse, out, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                         stride_xb, stride_xh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(mid_lse + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty sequence (a padding row): all weights 0
    weight = tl.exp(lse - top)
    total = tl.sum(weight, 0)
    parts = tl.load(mid_o + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    merged = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + b * stride_xb + h * stride_xh + d, merged.to(out.dtype.element_ty), mask=d_mask)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, page_size: int, scale: float, splits: int = 1,
                     block_n: int = 64) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context, ``[batch, heads, head_dim]``.

    ``q``: ``[batch, heads, head_dim]``; ``k_cache``/``v_cache``: one layer of the pool, ``[kv_heads, slots,
    head_dim]``; ``block_tables``: ``[batch, width]`` int32 (row ``b`` covers its first ``context_lens[b]``
    tokens); ``context_lens``: ``[batch]`` int32, the keys each query sees (0: a padding row, output 0).
    ``splits`` parts of each context are reduced in parallel and merged by log-sum-exp.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    mid_o = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_d = _pow2(head_dim, 16)
    _decode_partial_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, mid_o, mid_lse, scale, page_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_H=_pow2(group, 16), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        SPLITS=splits, EXACT=_exact(q.dtype), num_warps=4)
    _decode_merge_kernel[(batch, heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=splits,
        BLOCK_S=_pow2(splits, 2), num_warps=4)
    return out


@triton.jit
def _prefill_kernel(q, k_cache, v_cache, out, block_tables, cu_q, positions, scale, page_size,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cs, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    first = tl.load(cu_q + seq)
    last = tl.load(cu_q + seq + 1)
    rows = first + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < last  # a tile past its sequence's queries has no row: it loops over no key
    pos = tl.load(positions + rows, mask=row_mask, other=-1)
    keys_end = tl.max(pos, 0) + 1  # positions ascend: the tile's last query sees the most keys
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    query = tl.load(q + rows[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kvh = h // GROUP
    k_base = k_cache + kvh * stride_ch
    v_base = v_cache + kvh * stride_ch
    table = block_tables + seq * stride_bt
    for n0 in range(0, keys_end, BLOCK_N):
        n, n_mask, keys, values = _kv_tile(table, n0, keys_end, page_size, k_base, v_base, stride_cs, d, d_mask,
                                           BLOCK_N)
        visible = (n[None, :] <= pos[:, None]) & n_mask[None, :]
        scores = tl.where(visible, _dot(query, tl.trans(keys), EXACT) * scale, float("-inf"))
        m, denom, acc = _softmax_tile(scores, values, m, denom, acc, EXACT)
    result = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out + rows[:, None].to(tl.int64) * stride_ot + h * stride_oh + d[None, :],
             result.to(out.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_q: torch.Tensor, positions: torch.Tensor, max_q: int, page_size: int,
                      scale: float) -> torch.Tensor:
    """Attention of packed query tokens over their sequences' paged K/V (already in the pool), causal by position.

    ``q``: ``[tokens, heads, head_dim]``, sequence ``s`` owning rows ``cu_q[s]..cu_q[s+1]-1`` (``cu_q``: int32,
    ``[sequences + 1]``); ``positions``: ``[tokens]``, ascending within a sequence: row ``i`` sees keys
    ``0..positions[i]`` of its sequence; ``block_tables``: ``[sequences, width]`` int32; ``max_q``: the most
    rows of one sequence (the launch grid's size). Returns ``[tokens, heads, head_dim]`` in ``q``'s dtype.
    """
    _tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty_like(q)
    fp32 = q.dtype == torch.float32
    block_m, block_n = (32, 32) if fp32 or head_dim > 64 else (64, 64)
    grid = (cu_q.shape[0] - 1, triton.cdiv(max_q, block_m), heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_q, positions, scale, page_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim, 16),
        BLOCK_M=block_m, BLOCK_N=block_n, EXACT=_exact(q.dtype), num_warps=4)
    return out
