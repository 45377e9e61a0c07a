"""The CUDA runner's forward step as one pure tensor function over the block pool.

:func:`step` runs a packed batch of tokens of several sequences through a llama-family model (llama, qwen2,
mistral: pre-norm attention with grouped K/V heads and a gated MLP) as a fixed sequence of tensor
operations: no Python branch depends on the data, no host synchronisation, every tensor's shape fixed by the
batch's shape. That is what lets the CUDA runner capture a decode step once per batch-size bucket in a CUDA
graph and replay it with new inputs copied into the same buffers (:class:`StepBatch`'s tensors).

- :class:`StepWeights`: the model's weights as the step reads them: q/k/v and gate/up concatenated once
  (one matrix product each instead of three and two), the norms and activation of the Hugging Face modules
  themselves, and the rotary cos/sin of every position up to the model's context computed once by the
  model's own rotary module (the same values, elementwise, as it computes per call).
- :class:`StepBatch`: the device inputs: token ids, positions, the pool slot each token's K/V goes to (-1:
  a padding row that writes nothing), each sequence's block table and context length, and for prefill the
  packed layout (``cu_q``) and the rows that need logits.
- the stages that are not matrix products (a :class:`StepOps`: residual add + RMSNorm, rotary + K/V store,
  paged attention) are passed in: fused Triton kernels on CUDA (``ops.TritonOps``), the model's modules and
  plain torch elsewhere (``ops.TorchOps``), which is how the step is tested on CPU against the eager runner.

The operations and their dtypes follow the Hugging Face decoder layer (``residual + o_proj(attn)``, RMSNorm in
fp32 then cast, rotary in the model's dtype), so fp32 results agree with the eager runner to rounding.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from ..loader import LoadedModel


@dataclass
class StepBatch:
    """One step's inputs, on the model's device (int32 throughout, so one host buffer uploads them all).

    ``tokens`` rows: ``input_ids``, ``positions``, ``slots``. ``sequences`` rows: ``block_tables``
    (``[sequences, width]``), ``context_lens`` (keys its last query sees: its last position + 1; 0 for a
    padding row). A decode step has one token per row (``cu_q`` None, logits for every row): a decode step of
    each sequence, or the tokens of a short chunk as rows of their sequence, each at its own position with
    its own context length (row ``i`` sees keys up to its position, so a chunk's rows are causal); a prefill
    step packs sequence ``s`` in rows ``cu_q[s]..cu_q[s+1]-1`` and wants logits of ``logit_rows`` only.
    ``kv_slots``/``cu_k``/``max_k``: every key of every sequence in order (slots ``0..context_len-1``), for
    attention that reads K/V gathered contiguous (flash varlen); None when the attention reads the pool itself.
    ``local``: every sequence's keys are exactly this step's tokens (fresh prompts from position 0, dense), so
    attention can read the step's own K/V instead of the pool (``StepOps.prefill_local``); ``q_bounds``: ``cu_q``
    on the host.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    cu_q: torch.Tensor | None = None
    max_q: int = 1
    logit_rows: torch.Tensor | None = None
    dense: bool = True  # every sequence's positions are consecutive (no sparse recomputation)
    kv_slots: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_k: int = 0
    local: bool = False
    q_bounds: tuple[int, ...] = ()

    @property
    def decode(self) -> bool:
        return self.cu_q is None


class StepOps(Protocol):
    """The stages of :func:`step` that are not matrix products: on CUDA fused Triton kernels (``ops.TritonOps``),
    elsewhere the model's own modules and plain torch (``ops.TorchOps``). Pool tensors are one layer's
    ``[kv_heads, slots, head_dim]``."""

    name: str
    # Whether prefill reads each sequence's keys gathered contiguous: the batch then lists them (``kv_slots``).
    gathers: bool
    # Whether a local batch (``StepBatch.local``) attends over the step's own K/V (``prefill_local``).
    local_prefill: bool

    def add_norm(self, hidden: torch.Tensor, x: torch.Tensor | None, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, norm(h))`` with ``h = hidden + x`` (``h = hidden`` when ``x`` is None), ``[tokens, hidden]``."""
        ...

    def rope_store(self, qkv: torch.Tensor, w: StepWeights, batch: StepBatch, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
        """Rotate q and k of the fused projection at ``batch.positions``, write k and v at ``batch.slots`` (-1:
        no write); the rotated q, ``[tokens, heads, head_dim]``."""
        ...

    def rope_store_kv(self, qkv: torch.Tensor, w: StepWeights, batch: StepBatch, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`rope_store`, and the rotated k and the v too: ``(q, k, v)``, k and v ``[tokens, kv_heads,
        head_dim]``."""
        ...

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch,
               scale: float) -> torch.Tensor:
        """``q``: ``[sequences, heads, head_dim]``, one token each; its attention over the pool."""
        ...

    def prefill_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch,
                      scale: float) -> torch.Tensor:
        """Causal attention of a local batch's packed sequences over their own ``k``/``v`` (no pool read)."""
        ...

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch,
                scale: float) -> torch.Tensor:
        """``q``: ``[tokens, heads, head_dim]`` packed by ``batch.cu_q``; causal by position over the pool."""
        ...


@dataclass
class Norm:
    """An RMSNorm: the model's module (what the torch path calls) and its weight and epsilon (the kernel's)."""

    module: torch.nn.Module
    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: torch.nn.Module) -> Norm:
        return cls(module, module.weight.detach(), float(module.variance_epsilon))


@dataclass
class LayerWeights:
    input_norm: Norm
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: Norm
    gate_up: torch.Tensor
    down: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]


def _fuse(modules: list[torch.nn.Module], share: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The modules' weights (and biases) concatenated along the output. ``share``: the modules' own parameters
    become views of the fused copy, so the model keeps one copy of its weights (same values, same results)."""
    weight = torch.cat([m.weight.detach() for m in modules])
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(m.weight.shape[0])
                          for b, m in zip(biases, modules)])
    if share:
        row = 0
        for i, m in enumerate(modules):
            rows = m.weight.shape[0]
            m.weight.data = weight[row : row + rows]
            if bias is not None and biases[i] is not None:
                m.bias.data = bias[row : row + rows]
            row += rows
    return weight, bias


class StepWeights:
    """A model's weights as :func:`step` reads them (see the module). Built once per loaded model."""

    def __init__(self, loaded: LoadedModel, share: bool = False) -> None:
        model = loaded.model
        inner = model.model
        config = model.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = loaded.num_kv_heads
        self.head_dim = loaded.head_dim
        self.intermediate = int(config.intermediate_size)
        self.vocab = loaded.vocab_size
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = Norm.of(inner.norm)
        self.lm_head = model.lm_head.weight.detach()
        self.lm_head_bias = None if model.lm_head.bias is None else model.lm_head.bias.detach()
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], share)
            gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj], share)
            self.layers.append(LayerWeights(
                input_norm=Norm.of(layer.input_layernorm), qkv=qkv, qkv_bias=qkv_bias, o=attn.o_proj.weight.detach(),
                o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
                post_norm=Norm.of(layer.post_attention_layernorm), gate_up=gate_up, down=mlp.down_proj.weight.detach(),
                act=mlp.act_fn))
        # cos/sin of every position, by the model's own rotary module (elementwise in the position, so the
        # same values it gives per call), in the model's dtype as it returns them.
        self.max_positions = loaded.max_context
        with torch.inference_mode():
            probe = torch.empty(1, dtype=loaded.dtype, device=loaded.device)
            positions = torch.arange(self.max_positions, device=loaded.device)[None]
            cos, sin = inner.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [positions, head_dim]


_WEIGHTS: weakref.WeakKeyDictionary[torch.nn.Module, StepWeights] = weakref.WeakKeyDictionary()
_WEIGHTS_LOCK = threading.Lock()


def step_weights(loaded: LoadedModel, share: bool = False) -> StepWeights:
    """The model's :class:`StepWeights`, built once per loaded model and shared by its engines."""
    with _WEIGHTS_LOCK:
        weights = _WEIGHTS.get(loaded.model)
        if weights is None:
            weights = _WEIGHTS[loaded.model] = StepWeights(loaded, share)
        return weights


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The Hugging Face rotary convention: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def step(w: StepWeights, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: StepBatch, ops: StepOps) -> torch.Tensor:
    """Write every token's K/V into the pool and return fp32 logits ``[rows, vocab]``: every row for a decode
    step, ``batch.logit_rows`` for prefill. ``k_pool``/``v_pool``: the pool's ``[layers, kv_heads, slots,
    head_dim]`` tensors. The residual stream and each norm's output come from one ``add_norm`` per norm, as the
    decoder layer computes them (``h = h + sublayer(norm(h))``)."""
    tokens = batch.input_ids.shape[0]
    q_width = w.heads * w.head_dim
    layers = w.layers
    local = not batch.decode and batch.local and ops.local_prefill
    hidden, normed = ops.add_norm(F.embedding(batch.input_ids, w.embed), None, layers[0].input_norm)
    for index, layer in enumerate(layers):
        k_cache, v_cache = k_pool[index], v_pool[index]
        qkv = F.linear(normed, layer.qkv, layer.qkv_bias)
        if local:  # fresh prompts: attention over this step's own K/V, the pool only written
            q, k, v = ops.rope_store_kv(qkv, w, batch, k_cache, v_cache)
            out = ops.prefill_local(q, k, v, batch, w.scale)
        elif batch.decode:
            out = ops.decode(ops.rope_store(qkv, w, batch, k_cache, v_cache), k_cache, v_cache, batch, w.scale)
        else:
            out = ops.prefill(ops.rope_store(qkv, w, batch, k_cache, v_cache), k_cache, v_cache, batch, w.scale)
        hidden, normed = ops.add_norm(hidden, F.linear(out.reshape(tokens, q_width), layer.o, layer.o_bias),
                                      layer.post_norm)
        gate_up = F.linear(normed, layer.gate_up)
        mlp = F.linear(layer.act(gate_up[:, : w.intermediate]) * gate_up[:, w.intermediate :], layer.down)
        hidden, normed = ops.add_norm(hidden, mlp, layers[index + 1].input_norm if index + 1 < len(layers) else w.norm)
    if batch.logit_rows is not None:
        normed = normed.index_select(0, batch.logit_rows)
    return F.linear(normed, w.lm_head, w.lm_head_bias).float()
