"""One forward pass of the model over a packed batch of sequence chunks.

Each chunk is a run of new tokens of one sequence whose earlier tokens are already in the pool.
All chunks are concatenated into a single ``[1, total_tokens]`` input (prefill chunks and decode
steps alike), so the weights are read once per step for every sequence in it. A batch of decode
steps only (one new token per sequence), or of chunks of a few tokens in all (fp32: a turn's short
tail, a handful of recomputed tokens), goes through the fused decode step instead (``fast_decode``),
which skips the Hugging Face module stack and reads the weights at close to memory bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import BATCH_KWARG, AttentionBatch, build_seq_attention, build_sparse_attention
from .block_pool import BlockPool
from .fast_decode import FastDecoder
from .loader import LoadedModel


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


class ModelRunner:
    def __init__(self, loaded: LoadedModel, pool: BlockPool, fast_decode: bool = True) -> None:
        self.loaded = loaded
        self.pool = pool
        self._model = loaded.model
        self._device = loaded.device
        self.fast: FastDecoder | None = FastDecoder.build(loaded, pool) if fast_decode else None

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """Write the chunks' K/V into the pool; return fp32 logits per chunk: ``[vocab]`` for its last
        token, or ``[tokens, vocab]`` when the chunk asks for all of them."""
        if self.fast is not None and not any(c.all_logits for c in chunks):
            rows = sum(len(c.token_ids) for c in chunks)
            if all(len(c.token_ids) == 1 for c in chunks) or rows <= self.fast.small_chunk_rows:
                return self._fused_rows(self.fast, chunks)
        input_ids: list[int] = []
        positions: list[int] = []
        seqs = []
        rows: list[int] = []
        spans: list[tuple[int, int, bool]] = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            if chunk.positions is None:
                seqs.append(build_seq_attention(self.pool, list(chunk.blocks), len(input_ids), chunk.start, n))
                positions.extend(range(chunk.start, chunk.start + n))
            else:
                seqs.append(build_sparse_attention(self.pool, list(chunk.blocks), len(input_ids), chunk.positions))
                positions.extend(chunk.positions)
            input_ids.extend(chunk.token_ids)
            first = len(rows)
            rows.extend(range(len(input_ids) - n, len(input_ids)) if chunk.all_logits else [len(input_ids) - 1])
            spans.append((first, len(rows), chunk.all_logits))
        ids = torch.tensor([input_ids], dtype=torch.long, device=self._device)
        pos = torch.tensor([positions], dtype=torch.long, device=self._device)
        hidden = self._model.model(
            input_ids=ids,
            position_ids=pos,
            use_cache=False,
            **{BATCH_KWARG: AttentionBatch(pool=self.pool, seqs=seqs)},
        ).last_hidden_state
        # Usually only the last token of each chunk needs logits: skip the LM head everywhere else.
        logits = self._model.lm_head(hidden[0, torch.tensor(rows, device=self._device)]).float()
        return _separate([logits[a:b] if every else logits[a] for a, b, every in spans])

    @staticmethod
    def _fused_rows(fast: FastDecoder, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """Decode steps, and chunks of a few tokens, as rows of one fused step (see ``FastDecoder``)."""
        blocks: list[Sequence[int]] = []
        positions: list[int] = []
        tokens: list[int] = []
        last: list[int] = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            blocks.extend([chunk.blocks] * n)
            positions.extend(chunk.positions if chunk.positions is not None else range(chunk.start, chunk.start + n))
            tokens.extend(chunk.token_ids)
            last.append(len(tokens) - 1)
        logits = fast.forward(blocks, positions, tokens)
        return _separate([logits[i] for i in last] if len(last) < len(tokens) else list(logits))

    @torch.inference_mode()
    def deviation(self, blocks: Sequence[int], start: int, token_ids: Sequence[int]) -> torch.Tensor:
        """How far each of ``token_ids`` (at positions ``start..``, K/V in the pool computed in another
        context and re-aligned) is from its K/V behind this sequence's real context: the relative
        distance of its layer-1 V from the recomputed one, ``[len(token_ids)]``.

        Layer 0 is recomputed exactly on the way (its K/V depend only on token and position, and its
        output on the real context), so only layers 1.. of these tokens stay approximate. CacheBlend's
        selection signal: the tokens whose early-layer K/V deviate most are the ones to recompute.
        """
        inner = self._model.model
        n = len(token_ids)
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self._device)
        pos = torch.arange(start, start + n, device=self._device)[None]
        hidden = inner.embed_tokens(ids)
        rope = inner.rotary_emb(hidden, position_ids=pos)
        batch = AttentionBatch(pool=self.pool, seqs=[build_seq_attention(self.pool, list(blocks), 0, start, n)])
        hidden = inner.layers[0](hidden, attention_mask=None, position_ids=pos, position_embeddings=rope,
                                 **{BATCH_KWARG: batch})
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        second = inner.layers[1]
        v = second.self_attn.v_proj(second.input_layernorm(hidden))[0]  # [n, kv_heads * head_dim]
        _, cached = self.pool.read(1, self.pool.slots(list(blocks), start, start + n))  # [kv_heads, n, head_dim]
        cached = cached.transpose(0, 1).reshape(n, -1).to(v.dtype)
        return ((v - cached).float().pow(2).sum(-1) / cached.float().pow(2).sum(-1).clamp_min(1e-12)).cpu()


def _separate(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sequence's logits in storage of its own: a view into the batch's logits would keep the
    whole batch's (``rows x vocab`` floats, megabytes) alive for as long as a handle keeps its last
    logits (``KVState.last_logits``), a cost that grew with every live handle (issue 20's soak)."""
    if len(parts) == 1 and parts[0].untyped_storage().nbytes() == parts[0].nbytes:
        return parts
    return [p.clone() for p in parts]
