"""Decode steps without the framework's per-layer overhead.

Once prefill is shared, a multi-agent workflow spends its time decoding, and a decode step of a
small model is not bound by arithmetic (one token of the default model is ~0.3 GFLOP): it is bound
by reading the weights and by the Python and dispatch work of the Hugging Face module stack (tens
of module calls, hooks and shape checks per layer). This module runs the decode step of a
llama-family model as a short, explicit sequence of tensor operations over the *same* weights:

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
(``compute/eager.py``). Models this module does not know fall back to it too, logged once.
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

from ...cache.block_pool import BlockPool
from ..loader import LoadedModel
from . import kernels as kernel_library

log = logging.getLogger(__name__)

# The decoder layers of these families share one structure (pre-norm attention + gated MLP).
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# oneDNN packs a weight for an expected batch size; 8 was fastest for 1..32 rows on the 2-core CI VM.
_PACK_BATCH = 8
_REFUSED: set[str] = set()  # reasons already logged


def _warn_once(reason: str, message: str) -> None:
    """Log a fallback (``message % reason``) the first time its reason comes up in this process."""
    if reason not in _REFUSED:
        _REFUSED.add(reason)
        log.warning(message, reason)


def unsupported_reason(model: Any) -> str | None:
    """Why the fast path cannot run this model (None: it can)."""
    name = type(model).__name__
    if name not in SUPPORTED:
        return f"{name} is not one of {', '.join(SUPPORTED)}"
    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    return None


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
    """None when kvbaton's C++ kernels handle this model's shapes; else why not."""
    config = model.config
    layer = model.model.layers[0]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in (64, 128) or config.intermediate_size % _LANES:
        return "head_dim must be 64 or 128 and intermediate_size a multiple of 16"
    if config.hidden_size % 2:  # bf16 weights are packed in pairs along the input
        return "hidden_size must be even"
    if not all(hasattr(norm, "variance_epsilon") for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
        return "norms without variance_epsilon"
    return None


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
class _Layer:
    input_norm: torch.nn.Module
    qkv: _Linear
    o: _Linear
    post_norm: torch.nn.Module
    gate_up: _Linear
    down: _Linear
    act: Callable[[torch.Tensor], torch.Tensor]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The Hugging Face rotary convention (rotate_half), written out: x*cos + rotate_half(x)*sin.
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecodeWeights:
    """The decode step's view of one model: fused (and packed) projections plus its own modules."""

    def __init__(self, loaded: LoadedModel, kernels: str, library: Any = None) -> None:
        model = loaded.model
        config = model.config
        inner = model.model
        self.kernels = kernels
        self.library = library  # the compiled kvbaton kernels when kernels == KVBATON
        linear = lambda *modules: _Linear(modules, kernels, library)  # noqa: E731
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = loaded.num_kv_heads
        self.head_dim = loaded.head_dim
        self.intermediate = config.intermediate_size
        self.scale = inner.layers[0].self_attn.scaling
        self.embed = inner.embed_tokens.weight.detach()
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.lm_head = linear(model.lm_head)
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm,
                qkv=linear(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                o=linear(layer.self_attn.o_proj),
                post_norm=layer.post_attention_layernorm,
                gate_up=linear(layer.mlp.gate_proj, layer.mlp.up_proj),
                down=linear(layer.mlp.down_proj),
                act=layer.mlp.act_fn,
            )
            for layer in inner.layers
        ]

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
        residual = F.embedding(torch.tensor(list(token_ids)), w.embed).float()  # the residual stream, fp32
        cos, sin = w.rotary(residual[None], torch.tensor([list(positions)]))  # fp32, [1, n, head_dim]
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        layers = w.layers
        normed = lib.rms_norm(residual, layers[0].input_norm.weight, layers[0].input_norm.variance_epsilon)
        for index, layer in enumerate(layers):
            q = lib.rope_write(layer.qkv(normed), cos, sin, pool.k, pool.v, index, slots, w.num_heads, w.num_kv_heads)
            attn = lib.attention(q, pool.k, pool.v, index, table, lengths, bs, w.scale)
            post = layer.post_norm
            normed = lib.add_rms_norm(residual, layer.o(attn), post.weight, post.variance_epsilon)
            mlp = layer.down(lib.silu_mul(layer.gate_up(normed)))
            norm = layers[index + 1].input_norm if index + 1 < len(layers) else w.norm
            normed = lib.add_rms_norm(residual, mlp, norm.weight, norm.variance_epsilon)
        return w.lm_head(normed)

    def _forward_torch(self, blocks: Sequence[Sequence[int]], positions: Sequence[int],
                       token_ids: Sequence[int]) -> torch.Tensor:
        n = len(token_ids)
        w, pool, device = self.weights, self.pool, self.device
        bs = pool.block_size
        write = torch.tensor([blocks[i][p // bs] * bs + p % bs for i, p in enumerate(positions)], device=device)
        reads = [pool.slots(blocks[i], 0, p + 1) for i, p in enumerate(positions)]
        pos = torch.tensor([list(positions)], device=device)
        hidden = F.embedding(torch.tensor(list(token_ids), device=device), w.embed)
        cos, sin = w.rotary(hidden, pos)  # [1, n, head_dim] each
        cos, sin = cos[0, :, None], sin[0, :, None]
        heads, kv_heads, d = w.num_heads, w.num_kv_heads, w.head_dim
        group = heads // kv_heads
        q_end = heads * d
        k_end = q_end + kv_heads * d
        inner = w.intermediate
        for index, layer in enumerate(w.layers):
            qkv = layer.qkv(layer.input_norm(hidden))
            qk = _rotate(qkv[:, :k_end].view(n, heads + kv_heads, d), cos, sin)  # q and k heads in one go
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, k_end:].view(n, kv_heads, d)
            pool.write(index, write, k.transpose(0, 1), v.transpose(0, 1))
            # Query heads sharing a K/V head attend together: [1, kv_heads, group, d] against its K/V.
            outs = []
            for i in range(n):
                keys, values = pool.read(index, reads[i])
                query = q[i].view(1, kv_heads, group, d)
                outs.append(F.scaled_dot_product_attention(query, keys[None], values[None], scale=w.scale))
            attn = torch.cat(outs).view(n, heads * d)
            hidden = hidden + layer.o(attn)
            gate_up = layer.gate_up(layer.post_norm(hidden))
            hidden = hidden + layer.down(layer.act(gate_up[:, :inner]) * gate_up[:, inner:])
        return w.lm_head(w.norm(hidden)).float()
