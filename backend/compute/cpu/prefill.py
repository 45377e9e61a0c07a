"""Prefill on CPU: the Hugging Face model's forward with fewer, larger kernels.

A cold prefill of a few thousand tokens is arithmetic: the linear layers and the attention. The
model's own modules spend it in small pieces — q, k and v as three matrix products, gate and up as
two, RoPE as eight elementwise passes over q and k, ``silu(gate) * up`` as two more — and PyTorch's
CPU flash attention reaches well under the matrix products' speed. :func:`install` patches the
engine's model instance (never the class, never the reference model transformers loads separately):

- q/k/v and gate/up are each one matrix product, and every projection of the decoder layers runs on
  a copy of its (concatenated) weights pre-packed once for oneDNN (``torch.ops.mkldnn``), faster
  than the default fp32 GEMM on large inputs, its rows padded to a bucket (:mod:`.row_buckets`:
  oneDNN keeps kernels for every row count); forwards of a few rows use the modules' own weights;
- RoPE rotates q and k in place in the fused product's output, ``silu(gate) * up`` and each RMSNorm
  are one pass of a kvbaton kernel each (:mod:`.kernels`), threaded over the rows;
- the paged attention (:mod:`.attention`) of a chunk of new tokens is kvbaton's causal flash kernel
  (:func:`attention`), reading K/V straight from the pool, the query heads of a GQA group sharing
  every K/V tile, with no mask and no log-sum-exp merge for chunks behind cached tokens; tokens
  recomputed at scattered positions among cached ones (a blended segment) use the same kernel, each
  query limited to the keys up to its own position, instead of SDPA with a dense mask.

The modules' structure, weights, norms, rotary cos/sin and attention scale all still come from the
Hugging Face definition; a patched layer is checked against the original one at install time and
not patched when they disagree. Results stay within float rounding of the unpatched forward (logits
within 1e-4 of plain transformers, the same greedy tokens: ``tests/test_exactness.py``,
``tests/test_prefill.py``). fp32 only: in bf16, transformers' linears already run on oneDNN and the
kernels are fp32 (measured no faster). The packed copy costs the size of the decoder layers' weights
(405 MiB for the default model), logged at install. ``KVBATON_FUSED_PREFILL=0`` switches all of it
off; :func:`disabled` does so temporarily (profiling, tests).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvbaton.errors import ModelNotFound

from ...models import Architecture, architecture_of
from ...models import modules as model_modules
from ...models.paths import FUSED_PREFILL, KERNEL_HEAD_DIMS
from . import kernels as kernel_library
from . import row_buckets

log = logging.getLogger(__name__)

_OFF = ("0", "false", "off", "no")
# oneDNN pays off from this many rows; below it (a decode step through the model's forward, the LM
# head of one token) a packed weight is slower than the plain product.
PACKED_MIN_ROWS = 16
_PACK_BATCH = 512  # the batch size oneDNN packs the weights for
_off = 0  # > 0 while inside disabled()
_INSTALLED: set[int] = set()  # id() of patched models
_LOCK = threading.Lock()
_NO_SLOTS = torch.empty(0, dtype=torch.long)


def _enabled() -> bool:
    return _off == 0


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """While inside, every forward (any thread: the scheduler's too) runs the model's own modules and
    PyTorch's attention, as without :func:`install` (A/B measurements, tests)."""
    global _off
    with _LOCK:
        _off += 1
    try:
        yield
    finally:
        with _LOCK:
            _off -= 1


def _switched_off() -> bool:
    return os.environ.get("KVBATON_FUSED_PREFILL", "1").lower() in _OFF


class _Linear:
    """``x W^T (+ b)`` over nn.Linear modules concatenated along the output (2-D ``x``): one product on a
    oneDNN-packed copy of the concatenated weights for many rows, the modules' own weights otherwise."""

    def __init__(self, modules: Sequence[torch.nn.Module], pack: bool) -> None:
        self.modules = list(modules)
        weights = [m.weight.detach() for m in modules]
        self.dtype = weights[0].dtype
        self.bias = None
        if any(m.bias is not None for m in modules):
            self.bias = torch.cat([m.bias.detach() if m.bias is not None else w.new_zeros(w.shape[0])
                                   for m, w in zip(modules, weights)])
        # Only the packed copy is kept: the concatenation is a temporary (the modules' weights may be
        # views of one storage holding the whole checkpoint, so new plain copies would not replace them).
        self.packed = None
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights) if len(weights) > 1 else weights[0],
                                                                  _PACK_BATCH)

    @property
    def packed_bytes(self) -> int:
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] >= PACKED_MIN_ROWS and x.dtype == self.dtype:
            # Rows bucketed: oneDNN keeps kernels for every row count it sees (see row_buckets).
            rows = row_buckets.pad_rows(x.contiguous())
            y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
            return y[: x.shape[0]]
        if len(self.modules) == 1:
            return F.linear(x, self.modules[0].weight, self.modules[0].bias)
        return torch.cat([F.linear(x, m.weight, m.bias) for m in self.modules], dim=-1)


class _Norm:
    """An RMSNorm module's forward as one kernel call (fp32): one pass over the rows, not five. Its weight is
    the registry's (``1 + w`` for Gemma's norms)."""

    def __init__(self, module: torch.nn.Module, arch: Architecture, library: Any) -> None:
        self.module, self.library = module, library
        self.original = module.forward
        self.weight = model_modules.norm_weight(module, arch)
        self.eps = model_modules.norm_eps(module)

    def install(self) -> None:
        self.module.forward = self

    def uninstall(self) -> None:
        self.module.forward = self.original

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not _enabled() or self.library is None or x.dtype != torch.float32 or weight.dtype != torch.float32 \
                or x.shape[-1] % 16:
            return self.original(x)
        rows = x.reshape(-1, x.shape[-1])
        return self.library.rms_norm_rows(rows.contiguous(), weight, self.eps).view(x.shape)


class _Layer:
    """The fused pieces of one decoder layer and the forwards that use them."""

    def __init__(self, model: Any, arch: Architecture, index: int, pack: bool, library: Any) -> None:
        mods = model_modules.layer_modules(model, arch, index)
        attn, mlp = mods.attn, mods.mlp
        self.attn, self.mlp = attn, mlp
        self.heads = arch.num_heads
        self.kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.intermediate = arch.intermediate_size
        self.library = library
        self.silu = arch.activation == "silu"
        # What transformers' module passes its attention function (kvbaton's paged attention reads the registry's
        # own copy from its batch; a forward without kvbaton metadata honours these).
        self.attention_kwargs = {"sliding_window": arch.windows[index], "softcap": arch.attn_softcap}
        self.act = mods.act
        self.qkv = _Linear(mods.qkv, pack)
        self.o = _Linear([mods.o], pack)
        self.gate_up = _Linear(mods.gate_up, pack)
        self.down = _Linear([mods.down], pack)
        self.q_norm, self.k_norm = mods.q_norm, mods.k_norm  # each q / k head, before RoPE (Qwen3, Gemma 3)
        self.qk_weights = None if mods.q_norm is None else (
            model_modules.norm_weight(mods.q_norm, arch), model_modules.norm_weight(mods.k_norm, arch),
            model_modules.norm_eps(mods.q_norm))
        self.original_attention = attn.forward
        self.original_mlp = mlp.forward
        self.norms = [_Norm(m, arch, library) for m in (mods.attn_norm, mods.attn_out_norm, mods.mlp_norm,
                                                         mods.mlp_out_norm) if m is not None]

    def matrices(self) -> list[_Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def install(self) -> None:
        self.attn.forward = self.attention_forward
        self.mlp.forward = self.mlp_forward
        for norm in self.norms:
            norm.install()

    def uninstall(self) -> None:
        self.attn.forward = self.original_attention
        self.mlp.forward = self.original_mlp
        for norm in self.norms:
            norm.uninstall()

    def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _enabled():
            return self.original_mlp(x)
        rows = x.reshape(-1, x.shape[-1])
        gate_up = self.gate_up(rows)
        if self.silu and self.library is not None and gate_up.dtype == torch.float32:
            hidden = self.library.silu_mul(gate_up)
        else:  # the module's own activation (SiLU, GELU-tanh) on the gate half
            hidden = self.act(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        return self.down(hidden).view(*x.shape[:-1], -1)

    def attention_forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.attn
        if not _enabled() or cache is not None or position_embeddings is None or hidden_states.shape[0] != 1 \
                or module.training:
            return self.original_attention(hidden_states, position_embeddings=position_embeddings,
                                           attention_mask=attention_mask, cache=cache, **kwargs)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        n = hidden_states.shape[1]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(hidden_states.reshape(n, -1))  # [n, (heads + 2 kv_heads) d], fresh: rotated in place
        if self.qk_weights is not None:
            if self.library is not None and qkv.dtype == torch.float32 and qkv.is_contiguous():
                self.library.head_norm_inplace(qkv, *self.qk_weights, heads, kv_heads)
            else:
                k_end = (heads + kv_heads) * d
                qkv[:, : heads * d] = self.q_norm(qkv[:, : heads * d].view(n, heads, d)).reshape(n, -1)
                qkv[:, heads * d : k_end] = self.k_norm(qkv[:, heads * d : k_end].view(n, kv_heads, d)).reshape(n, -1)
        cos, sin = position_embeddings  # [1, n, d], the model's rotary embedding for these positions
        if self.library is not None and qkv.dtype == torch.float32 and qkv.is_contiguous():
            self.library.rope_inplace(qkv, cos[0].contiguous(), sin[0].contiguous(), heads, kv_heads)
        else:  # the Hugging Face formula, q and k heads in one pass
            qk = qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d)
            half = d // 2
            c, s = cos[0, :, None], sin[0, :, None]
            qk.copy_(qk * c + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * s)
        query = qkv[:, : heads * d].view(1, n, heads, d).transpose(1, 2)
        key = qkv[:, heads * d : (heads + kv_heads) * d].view(1, n, kv_heads, d).transpose(1, 2)
        value = qkv[:, (heads + kv_heads) * d :].view(1, n, kv_heads, d).transpose(1, 2)
        interface = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
        kwargs = {**self.attention_kwargs, **kwargs}
        out, weights = interface(module, query, key, value, attention_mask, dropout=0.0, scaling=module.scaling,
                                 **kwargs)
        out = out.reshape(n, -1)
        return self.o(out if out.is_contiguous() else out.contiguous()).view(1, n, -1), weights


def _why_not(model: Any, device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"no fused prefill on {device.type}"
    if dtype != torch.float32:
        # transformers' bf16 linears already run on oneDNN, and the kernels are fp32: measured no faster.
        return f"{dtype} prefill already runs oneDNN's kernels"
    try:
        return FUSED_PREFILL.refusal(architecture_of(model))  # the registry: what the patched layers implement
    except ModelNotFound as exc:
        return str(exc)


def _agrees(model: Any, arch: Architecture, fused: _Layer) -> bool:
    """The patched layer 0 gives the original's output on a small random input (this transformers version)."""
    g = torch.Generator().manual_seed(0)
    dtype = fused.o.dtype
    positions = torch.arange(24)[None] + 5
    with torch.inference_mode():
        hidden = torch.randn(1, 24, arch.hidden_size, generator=g).to(dtype) * 3
        x = fused.norms[0].original(hidden)
        cos_sin = model_modules.rotary_tables(model, arch, x, positions)[arch.layer_rope[0]]
        expected = (fused.original_attention(x, position_embeddings=cos_sin, attention_mask=None)[0],
                    fused.original_mlp(x), fused.norms[0].original(hidden))
        got = (fused.attention_forward(x, position_embeddings=cos_sin, attention_mask=None)[0], fused.mlp_forward(x),
               fused.norms[0](hidden))
    # Rounding differs (other kernels, other summation orders); a wrong structure differs by O(1).
    tol = 1e-4
    return all(a.shape == b.shape and (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
               for a, b in zip(got, expected))


def install(model: Any, device: torch.device, dtype: torch.dtype) -> bool:
    """Patch this model instance's decoder layers for fused prefill (once); False when it does not apply."""
    with _LOCK:
        if id(model) in _INSTALLED:
            return True
        if _switched_off():
            log.info("fused prefill switched off by KVBATON_FUSED_PREFILL")
            return False
        reason = _why_not(model, device, dtype)
        if reason is not None:
            log.info("fused prefill unavailable (%s): prefill runs the model's own modules", reason)
            return False
        from .fast_decode import packing_available

        pack = packing_available(device, dtype) is None
        library = kernel_library.load()
        arch = architecture_of(model)
        with torch.no_grad():
            layers = [_Layer(model, arch, i, pack, library) for i in range(arch.num_layers)]
        if not _agrees(model, arch, layers[0]):
            log.warning("fused prefill disagrees with this transformers version's modules: not used")
            return False
        for layer in layers:
            layer.install()
        final = _Norm(model.model.norm, arch, library)
        final.install()
        _INSTALLED.add(id(model))
        model._kvbaton_prefill = layers  # keeps them (and their packed weights) with the model
        model._kvbaton_prefill_norm = final
        packed = sum(m.packed_bytes for layer in layers for m in layer.matrices())
        log.info("fused prefill ready: %s projections%s, %.0f MiB of packed weights",
                 "oneDNN-packed" if pack else "plain", " and kvbaton kernels" if library else "", packed / 2**20)
        return True


def projections(model: Any) -> list[tuple[Any, int, torch.dtype]]:
    """Every decoder projection as a prefill forward of this model runs it, ``(product, input width,
    input dtype)``: the fused products where :func:`install` patched the model, its modules otherwise
    (the benchmarks' matrix-product floor of a prefill chunk)."""
    layers = getattr(model, "_kvbaton_prefill", None)
    if layers:
        return [(m, m.modules[0].in_features, m.dtype) for layer in layers for m in layer.matrices()]
    out = []
    arch = architecture_of(model)
    for index in range(arch.num_layers):
        mods = model_modules.layer_modules(model, arch, index)
        for module in (*mods.qkv, mods.o, *mods.gate_up, mods.down):
            out.append((module, module.in_features, module.weight.dtype))
    return out


def attention(query: torch.Tensor, pool: Any, layer: int, read_slots: torch.Tensor | slice,
              scaling: float | None, positions: torch.Tensor | None = None, window: int = 0,
              softcap: float = 0.0) -> torch.Tensor | None:
    """Causal attention of a chunk's queries ``[heads, q_len, d]`` over its K/V in the pool (``read_slots``:
    its whole context, the chunk's own tokens last; query i sees the first ``kv_len - q_len + i + 1``), or,
    with ``positions`` (ascending, the last one ``kv_len - 1``), of queries scattered among the cached
    tokens, query i seeing keys ``0..positions[i]`` (selective recomputation); ``[1, heads, q_len, d]``.
    None when kvbaton's kernel does not apply (the caller uses SDPA)."""
    if not _enabled() or query.dtype != torch.float32 or query.device.type != "cpu" or query.shape[1] < 2 \
            or query.shape[-1] not in KERNEL_HEAD_DIMS:
        return None
    library = kernel_library.load()
    if library is None:
        return None
    if isinstance(read_slots, slice):  # consecutive slots: no index tensor
        slots, first, kv_len = _NO_SLOTS, read_slots.start, read_slots.stop - read_slots.start
    else:
        slots, first, kv_len = read_slots.contiguous(), 0, read_slots.numel()
    d = query.shape[-1]
    scale = scaling if scaling is not None else d**-0.5
    where = _NO_SLOTS if positions is None else positions.contiguous()
    out = library.prefill_attention(query.transpose(0, 1), pool.k, pool.v, layer, slots, first, kv_len, scale, where,
                                    window, softcap)
    return out.transpose(0, 1).unsqueeze(0)

