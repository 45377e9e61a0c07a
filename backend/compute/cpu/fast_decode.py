"""Decode steps without the framework's per-layer overhead.

Once prefill is shared, a multi-agent workflow spends its time decoding, and a decode step of a
small model is not bound by arithmetic (one token of the default model is ~0.3 GFLOP): it is bound
by reading the weights and by the Python and dispatch work of the Hugging Face module stack (tens
of module calls, hooks and shape checks per layer). This module runs the decode step of any family of
the registry (``kvbaton.backend.models``: where the weights are, which norms, activation, soft-capping,
sliding windows and rotary tables each layer uses) as a short, explicit sequence of tensor operations over
the *same* weights:

- q/k/v and gate/up projections fused into one matrix each, every matrix pre-packed once for the
  kernel that reads it, so a step streams the weights at close to memory bandwidth;
- on CPU, kvbaton's own kernels (``kernels``: one C++ call per op, built once per machine): a
  packed GEMV that streams weights sequentially, RMSNorm fused with the residual add, rotary fused
  with the K/V write into the pool, and attention that reads K/V through each sequence's block table
  (no gather), grouped query heads sharing each K/V load, long contexts split across cores;
- without them (no compiler, ``KVBATON_KERNELS=0``, GPU), the same step in torch ops: oneDNN-packed
  linears, K/V written with one indexed copy per layer, attention over block views;
- the weights, norms' epsilons, rotary embedding (cos/sin) and attention scale of the Hugging Face
  model itself, so the architecture still comes from its definition.

Prefill (and any step that needs more than one token's logits) still runs the Hugging Face model
(``compute/eager.py``). Models the registry does not know fall back to it too, logged once; head sizes
kvbaton's kernels are not compiled for (``models.paths.KERNEL_HEAD_DIMS``) run the torch ops.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvbaton.errors import ModelNotFound

from ...cache.block_pool import BlockPool
from ...models import Architecture, architecture_of
from ...models import modules as model_modules
from ...models.paths import FUSED_DECODE, kernel_refusal, model_refusal
from ..attention import softcapped_attention
from ..loader import LoadedModel
from . import kernels as kernel_library

log = logging.getLogger(__name__)
# oneDNN packs a weight for an expected batch size; 8 was fastest for 1..32 rows on the 2-core CI VM.
_PACK_BATCH = 8
_REFUSED: set[str] = set()  # reasons already logged


def _warn_once(reason: str, message: str) -> None:
    """Log a fallback (``message % reason``) the first time its reason comes up in this process."""
    if reason not in _REFUSED:
        _REFUSED.add(reason)
        log.warning(message, reason)


def unsupported_reason(model: Any) -> str | None:
    """Why the fast path cannot run this model (None: it can): the registry's answer for its family."""
    return model_refusal(FUSED_DECODE, model)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH)


def packing_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when oneDNN weight packing works here and gives F.linear's results; else why not."""
    if device.type != "cpu":
        return f"no packed kernels for {device.type}"
    if not torch.backends.mkldnn.is_available():
        return "PyTorch was built without oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no oneDNN bfloat16 kernels"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"no packed kernels for {dtype}"
    try:
        w = torch.randn(24, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
        x = torch.ones(3, 16, dtype=dtype)
        got = torch.ops.mkldnn._linear_pointwise(x, _pack(w), None, "none", [], "")
    except Exception as exc:  # an op missing from this build, an unsupported ISA
        return f"oneDNN packing failed: {exc}"
    if not torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2):
        return "oneDNN packed linear disagrees with F.linear"
    return None


# Names of the kernel sets, as `kvbaton info` and DecodeWeights.kernels report them.
KVBATON, ONEDNN, PLAIN = "kvbaton C++", "oneDNN packed", "plain"
_LANES = 16  # output rows per block of kvbaton's packed weight layout


def kernels_fit(model: Any) -> str | None:
    """None when kvbaton's C++ kernels handle this model's features and shapes; else why not."""
    try:
        return kernel_refusal(architecture_of(model))
    except ModelNotFound as exc:
        return str(exc)


class _Linear:
    """``y = x W^T (+ b)`` over one or more weight matrices concatenated along the output."""

    def __init__(self, modules: Sequence[torch.nn.Module], kind: str, library: Any = None) -> None:
        weights = [m.weight.detach() for m in modules]
        biases = [m.bias for m in modules]
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.out_features, self.in_features = weight.shape
        self.bias = None
        if any(b is not None for b in biases):
            parts = [b.detach() if b is not None else weight.new_zeros(w.shape[0]) for b, w in zip(biases, weights)]
            self.bias = torch.cat(parts)
        self.kind = kind
        self._library = library
        self.input_dtype = torch.float32 if kind == KVBATON else weight.dtype  # what __call__ takes
        if kind == KVBATON:  # blocks of 16 outputs, each one sequential run of memory (see the kernels)
            self.weight = library.pack(weight)
            if self.bias is not None:
                pad = self.weight.shape[0] * _LANES - self.out_features
                self.bias = torch.cat([self.bias.float(), self.bias.new_zeros(pad, dtype=torch.float32)]).contiguous()
        else:
            self.weight = _pack(weight) if kind == ONEDNN else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == KVBATON:  # fp32 in, fp32 out
            y = self._library.linear(x, self.weight, self.bias)
            return y if y.shape[1] == self.out_features else y[:, : self.out_features].contiguous()
        if self.kind == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@dataclass
class _Norm:
    """An RMSNorm: its module (the torch path calls it) and the weight (``1 + w`` for Gemma) and epsilon the
    kernels multiply by."""

    module: torch.nn.Module
    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: torch.nn.Module | None, arch: Architecture) -> _Norm | None:
        if module is None:
            return None
        return cls(module, model_modules.norm_weight(module, arch), model_modules.norm_eps(module))


@dataclass
class _Layer:
    attn_norm: _Norm
    attn_out_norm: _Norm | None  # Gemma's norm of the attention output
    mlp_norm: _Norm
    mlp_out_norm: _Norm | None
    q_norm: _Norm | None  # Qwen3 / Gemma 3: each q and k head, before RoPE
    k_norm: _Norm | None
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    window: int  # a sliding window of that many keys, or 0
    rope: str  # its rotary group


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The Hugging Face rotary convention (rotate_half), written out: x*cos + rotate_half(x)*sin, on the first
    # cos.shape[-1] dimensions (partial rotary embeddings leave the rest).
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((_rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecodeWeights:
    """The decode step's view of one model: fused (and packed) projections plus its own modules."""

    def __init__(self, loaded: LoadedModel, kernels: str, library: Any = None) -> None:
        model = loaded.model
        arch = loaded.arch or architecture_of(model)
        inner = model.model
        self.arch = arch
        self.model = model
        self.kernels = kernels
        self.library = library  # the compiled kvbaton kernels when kernels == KVBATON
        linear = lambda *modules: _Linear(modules, kernels, library)  # noqa: E731
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.intermediate = arch.intermediate_size
        self.scale = arch.query_scale
        self.softcap = arch.attn_softcap or 0.0
        self.final_softcap = arch.final_softcap
        self.silu = arch.activation == "silu"
        self.embed_tokens = inner.embed_tokens  # its forward scales the embedding where the family does
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = _Norm.of(inner.norm, arch)
        self.lm_head = linear(model.lm_head)
        self.layers = []
        for index in range(arch.num_layers):
            mods = model_modules.layer_modules(model, arch, index)
            self.layers.append(_Layer(
                attn_norm=_Norm.of(mods.attn_norm, arch), attn_out_norm=_Norm.of(mods.attn_out_norm, arch),
                mlp_norm=_Norm.of(mods.mlp_norm, arch), mlp_out_norm=_Norm.of(mods.mlp_out_norm, arch),
                q_norm=_Norm.of(mods.q_norm, arch), k_norm=_Norm.of(mods.k_norm, arch),
                qkv=linear(*mods.qkv), o=linear(mods.o), gate_up=linear(*mods.gate_up), down=linear(mods.down),
                act=mods.act, window=arch.windows[index] or 0, rope=arch.layer_rope[index],
            ))

    def rotary_tables(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin ``[n, rotary_dim]`` of each rotary group at ``positions`` (``[n]``), by the model's own module."""
        tables = model_modules.rotary_tables(self.model, self.arch, x[None], positions[None])
        return {group: (cos[0].contiguous(), sin[0].contiguous()) for group, (cos, sin) in tables.items()}

    def matrices(self) -> list[_Linear]:
        """Every weight matrix a decode step reads, LM head first."""
        return [self.lm_head] + [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    @property
    def nbytes(self) -> int:
        """Memory of these copies of the weights (packed and fused)."""
        return sum(m.weight.numel() * m.weight.element_size() for m in self.matrices())


# Packing takes about a second and a copy of the weights: once per loaded model, shared by its engines.
_WEIGHTS: weakref.WeakKeyDictionary[torch.nn.Module, DecodeWeights] = weakref.WeakKeyDictionary()
_WEIGHTS_LOCK = threading.Lock()


def _kvbaton_kernels(loaded: LoadedModel) -> Any:
    """The compiled kvbaton kernels if they can run this model here (else None, why logged once)."""
    if loaded.device.type != "cpu" or loaded.dtype not in (torch.float32, torch.bfloat16):
        return None
    why_not = kernels_fit(loaded.model)
    if why_not is not None:
        _warn_once(why_not, "kvbaton kernels do not fit this model (%s): fused decode uses oneDNN")
        return None
    return kernel_library.load()


def decode_weights(loaded: LoadedModel) -> DecodeWeights:
    with _WEIGHTS_LOCK:
        weights = _WEIGHTS.get(loaded.model)
        if weights is None:
            library = _kvbaton_kernels(loaded)
            if library is not None:
                weights = DecodeWeights(loaded, KVBATON, library)
            else:
                why_not = packing_available(loaded.device, loaded.dtype)
                if why_not is not None:
                    log.warning("fast decode without packed weights (%s): plain linear kernels", why_not)
                weights = DecodeWeights(loaded, PLAIN if why_not else ONEDNN)
            _WEIGHTS[loaded.model] = weights
            log.info("fast decode ready: %s kernels, %.0f MiB of decode weights", weights.kernels,
                     weights.nbytes / 2**20)
        return weights


# Chunks of up to this many new tokens in all (fp32, kvbaton's kernels) run as rows of one fused step:
# measured on the 2-core CI VM behind 2.4K cached tokens, 2 / 5 / 11 tokens took 28 / 38 / 60 ms that
# way against 98 / 86 / 109 ms through the model's modules (whose GEMMs pay the most for a few rows);
# from 16 rows on the modules' batched GEMMs and prefill attention win.
SMALL_CHUNK_ROWS = 12


class FastDecoder:
    """Runs decode steps (one new token per sequence, any number of sequences) for one engine's pool.

    A row is one token at one position of one sequence; rows of the same sequence form a small
    prefill chunk: every row's K/V is written into the pool before any row attends, and row i sees
    the positions up to its own, so they come out causal (:attr:`small_chunk_rows`)."""

    def __init__(self, weights: DecodeWeights, pool: BlockPool, device: torch.device) -> None:
        self.weights = weights
        self.pool = pool
        self.device = device
        # Only with fp32 kvbaton kernels: there a few-token chunk agrees with the modules' forward to
        # float rounding (logits within 1e-4); in bf16 the two paths round differently enough to flip
        # a close greedy choice, so bf16 chunks keep the prefill path that dense prefill uses.
        fp32 = weights.kernels == KVBATON and pool.k.dtype == torch.float32
        self.small_chunk_rows = SMALL_CHUNK_ROWS if fp32 else 0

    @classmethod
    def build(cls, loaded: LoadedModel, pool: BlockPool) -> FastDecoder | None:
        """The fast decoder for this model, or None (logged once) when it must use the model's forward."""
        reason = unsupported_reason(loaded.model)
        if reason is not None:
            _warn_once(reason, "fast decode unavailable (%s): decode steps run the model's own forward")
            return None
        return cls(decode_weights(loaded), pool, loaded.device)

    @torch.inference_mode()
    def forward(self, blocks: Sequence[Sequence[int]], positions: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Write K/V of one new token per sequence and return fp32 next-token logits ``[sequences, vocab]``.

        ``blocks[i]`` must cover positions ``0..positions[i]`` of sequence ``i``.
        """
        if self.weights.kernels == KVBATON:
            return self._forward_kernels(blocks, positions, token_ids)
        return self._forward_torch(blocks, positions, token_ids)

    def _forward_kernels(self, blocks: Sequence[Sequence[int]], positions: Sequence[int],
                         token_ids: Sequence[int]) -> torch.Tensor:
        w, pool, lib = self.weights, self.pool, self.weights.library
        bs = pool.block_size
        tables = [list(blocks[i][: p // bs + 1]) for i, p in enumerate(positions)]
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lengths = torch.tensor([p + 1 for p in positions])
        slots = torch.tensor([t[-1] * bs + p % bs for t, p in zip(tables, positions)])
        residual = w.embed_tokens(torch.tensor(list(token_ids))).float()  # the residual stream, fp32
        ropes = w.rotary_tables(residual, torch.tensor(list(positions)))  # fp32, [n, rotary_dim]
        layers = w.layers
        heads, kv_heads = w.num_heads, w.num_kv_heads
        first = layers[0].attn_norm
        normed = lib.rms_norm(residual, first.weight, first.eps)
        for index, layer in enumerate(layers):
            qkv = layer.qkv(normed)
            if layer.q_norm is not None:
                lib.head_norm_inplace(qkv, layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps, heads, kv_heads)
            cos, sin = ropes[layer.rope]
            q = lib.rope_write(qkv, cos, sin, pool.k, pool.v, index, slots, heads, kv_heads)
            attn = layer.o(lib.attention(q, pool.k, pool.v, index, table, lengths, bs, w.scale, layer.window,
                                         w.softcap))
            if layer.attn_out_norm is not None:
                attn = lib.rms_norm(attn, layer.attn_out_norm.weight, layer.attn_out_norm.eps)
            normed = lib.add_rms_norm(residual, attn, layer.mlp_norm.weight, layer.mlp_norm.eps)
            gate_up = layer.gate_up(normed)
            if w.silu:
                hidden = lib.silu_mul(gate_up)
            else:  # the module's own activation (GELU-tanh for Gemma), on the gate half
                hidden = layer.act(gate_up[:, : w.intermediate]) * gate_up[:, w.intermediate :]
            mlp = layer.down(hidden)
            if layer.mlp_out_norm is not None:
                mlp = lib.rms_norm(mlp, layer.mlp_out_norm.weight, layer.mlp_out_norm.eps)
            norm = layers[index + 1].attn_norm if index + 1 < len(layers) else w.norm
            normed = lib.add_rms_norm(residual, mlp, norm.weight, norm.eps)
        return model_modules.softcap_logits(w.lm_head(normed), w.final_softcap)

    def _forward_torch(self, blocks: Sequence[Sequence[int]], positions: Sequence[int],
                       token_ids: Sequence[int]) -> torch.Tensor:
        n = len(token_ids)
        w, pool, device = self.weights, self.pool, self.device
        bs = pool.block_size
        write = torch.tensor([blocks[i][p // bs] * bs + p % bs for i, p in enumerate(positions)], device=device)
        hidden = w.embed_tokens(torch.tensor(list(token_ids), device=device))
        ropes = w.rotary_tables(hidden, torch.tensor(list(positions), device=device))
        heads, kv_heads, d = w.num_heads, w.num_kv_heads, w.head_dim
        group = heads // kv_heads
        q_end = heads * d
        k_end = q_end + kv_heads * d
        inner = w.intermediate
        for index, layer in enumerate(w.layers):
            # Each row attends over its window (transformers': itself and the window - 1 keys before it).
            reads = [pool.slots(blocks[i], max(0, p + 1 - layer.window) if layer.window else 0, p + 1)
                     for i, p in enumerate(positions)]
            qkv = layer.qkv(layer.attn_norm.module(hidden))
            q, k = qkv[:, :q_end].view(n, heads, d), qkv[:, q_end:k_end].view(n, kv_heads, d)
            if layer.q_norm is not None:
                q, k = layer.q_norm.module(q), layer.k_norm.module(k)
            cos, sin = ropes[layer.rope]
            qk = _rotate(torch.cat((q, k), dim=1), cos[:, None], sin[:, None])  # q and k heads in one go
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, k_end:].view(n, kv_heads, d)
            pool.write(index, write, k.transpose(0, 1), v.transpose(0, 1))
            # Query heads sharing a K/V head attend together: [1, kv_heads, group, d] against its K/V.
            outs = []
            for i in range(n):
                keys, values = pool.read(index, reads[i])
                if w.softcap:
                    outs.append(softcapped_attention(q[i].view(1, heads, 1, d), keys, values, None, w.scale,
                                                     w.softcap))
                else:
                    query = q[i].view(1, kv_heads, group, d)
                    outs.append(F.scaled_dot_product_attention(query, keys[None], values[None], scale=w.scale))
            attn = layer.o(torch.cat(outs).reshape(n, heads * d))
            if layer.attn_out_norm is not None:
                attn = layer.attn_out_norm.module(attn)
            hidden = hidden + attn
            gate_up = layer.gate_up(layer.mlp_norm.module(hidden))
            mlp = layer.down(layer.act(gate_up[:, :inner]) * gate_up[:, inner:])
            if layer.mlp_out_norm is not None:
                mlp = layer.mlp_out_norm.module(mlp)
            hidden = hidden + mlp
        return model_modules.softcap_logits(w.lm_head(w.norm.module(hidden)), w.final_softcap).float()
