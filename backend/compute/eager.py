"""The eager runner: one forward of the Hugging Face model definition over a packed batch of chunks.

Each chunk is a run of new tokens of one sequence whose earlier tokens are already in the pool.
All chunks are concatenated into a single ``[1, total_tokens]`` input (prefill chunks and decode
steps alike), so the weights are read once per step for every sequence in it; paged attention
(:mod:`.attention`) writes and reads their K/V in the pool, the way the runner's
:class:`~.attention.AttentionBackend` says. A batch of decode steps only (one new token per
sequence), or of chunks of a few tokens in all (fp32: a turn's short tail, a handful of recomputed
tokens), goes through the fused decode step instead (``cpu/fast_decode``) when the runner has one,
which skips the Hugging Face module stack and reads the weights at close to memory bandwidth.

This is the CPU implementation of :class:`~.runner.ModelRunner` (with ``cpu/``'s fused prefill,
installed on the model by :mod:`.selector`), and what runs on other devices until they have their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..cache.block_pool import BlockPool
from ..models import modules as model_modules
from ..models import architecture_of
from .attention import BATCH_KWARG, AttentionBackend, AttentionBatch, build_seq_attention, build_sparse_attention
from .loader import LoadedModel
from .runner import Chunk

if TYPE_CHECKING:
    from .cpu.fast_decode import FastDecoder


class EagerRunner:
    """:class:`~.runner.ModelRunner` over the model's own forward (``fast``: the fused decode step, or None)."""

    def __init__(
        self, loaded: LoadedModel, pool: BlockPool, attention: AttentionBackend, fast: FastDecoder | None = None
    ) -> None:
        self.loaded = loaded
        self.pool = pool
        self.attention = attention
        self._model = loaded.model
        self._device = loaded.device
        self.fast = fast
        self.arch = loaded.arch or architecture_of(loaded.model)
        # What every AttentionBatch of this model carries: the layers' windows (None when no layer has one
        # shorter than the context) and the scores' soft-cap.
        self._windows = self.arch.windows if self.arch.sliding else None
        self._softcap = self.arch.attn_softcap

    def _batch(self, seqs: list) -> AttentionBatch:
        return AttentionBatch(pool=self.pool, seqs=seqs, backend=self.attention, windows=self._windows,
                              softcap=self._softcap)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """Write the chunks' K/V into the pool; return fp32 logits per chunk: ``[vocab]`` for its last
        token, or ``[tokens, vocab]`` when the chunk asks for all of them."""
        if self.fast is not None:
            # Decode rows, and chunks of a few tokens each (a turn's short tail, a few recomputed tokens, a decode
            # row with speculative drafts) as rows of one fused step.
            longest = max(len(c.token_ids) for c in chunks)
            if (longest == 1 and not any(c.all_logits for c in chunks)) or longest <= self.fast.small_chunk_rows:
                return self._fused_rows(self.fast, chunks)
        input_ids: list[int] = []
        positions: list[int] = []
        seqs = []
        rows: list[int] = []
        spans: list[tuple[int, int, bool]] = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            if chunk.positions is None:
                seqs.append(build_seq_attention(self.pool, list(chunk.blocks), len(input_ids), chunk.start, n,
                                                self.attention.split_prefix))
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
            **{BATCH_KWARG: self._batch(seqs)},
        ).last_hidden_state
        # Usually only the last token of each chunk needs logits: skip the LM head everywhere else.
        logits = self._model.lm_head(hidden[0, torch.tensor(rows, device=self._device)])
        logits = model_modules.softcap_logits(logits, self.arch.final_softcap).float()
        return separate([logits[a:b] if every else logits[a] for a, b, every in spans])

    @staticmethod
    def _fused_rows(fast: FastDecoder, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """Decode steps, and chunks of a few tokens, as rows of one fused step (see ``FastDecoder``)."""
        blocks: list[Sequence[int]] = []
        positions: list[int] = []
        tokens: list[int] = []
        spans: list[tuple[int, int, bool]] = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            blocks.extend([chunk.blocks] * n)
            positions.extend(chunk.positions if chunk.positions is not None else range(chunk.start, chunk.start + n))
            tokens.extend(chunk.token_ids)
            spans.append((len(tokens) - n, len(tokens), chunk.all_logits))
        logits = fast.forward(blocks, positions, tokens)
        if len(spans) == len(tokens):  # one row per chunk: the rows as they are
            return separate([logits[a] if not every else logits[a:b] for a, b, every in spans])
        return separate([logits[a:b] if every else logits[b - 1] for a, b, every in spans])

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
        arch = self.arch
        n = len(token_ids)
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self._device)
        pos = torch.arange(start, start + n, device=self._device)[None]
        hidden = inner.embed_tokens(ids)
        ropes = model_modules.rotary_tables(self._model, arch, hidden, pos)
        seq = build_seq_attention(self.pool, list(blocks), 0, start, n, self.attention.split_prefix)
        hidden = inner.layers[0](hidden, attention_mask=None, position_ids=pos,
                                 position_embeddings=ropes[arch.layer_rope[0]], **{BATCH_KWARG: self._batch([seq])})
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        second = model_modules.layer_modules(self._model, arch, 1)
        normed = second.attn_norm(hidden)[0]
        v_start = (arch.num_heads + arch.num_kv_heads) * arch.head_dim
        # [n, kv_heads * head_dim]: its own module, or the v part of a fused q/k/v projection
        v = second.qkv[2](normed) if len(second.qkv) == 3 else second.qkv[0](normed)[:, v_start:]
        _, cached = self.pool.read(1, self.pool.slots(list(blocks), start, start + n))  # [kv_heads, n, head_dim]
        cached = cached.transpose(0, 1).reshape(n, -1).to(v.dtype)
        return ((v - cached).float().pow(2).sum(-1) / cached.float().pow(2).sum(-1).clamp_min(1e-12)).cpu()


def separate(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sequence's logits in storage of its own: a view into the batch's logits would keep the
    whole batch's (``rows x vocab`` floats, megabytes) alive for as long as a handle keeps its last
    logits (``KVState.last_logits``), a cost that grew with every live handle (issue 20's soak)."""
    if len(parts) == 1 and parts[0].untyped_storage().nbytes() == parts[0].nbytes:
        return parts
    return [p.clone() for p in parts]
