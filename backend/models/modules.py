"""An architecture applied to a loaded transformers model: its layers' modules by role, each norm's effective
weight, the rotary tables of a batch of positions, and a check that the declaration matches the modules.

The compute paths that do not run the modules' own forward (fused decode, fused prefill, the CUDA step, the
deviation probe) take everything here, so a family's weight layout is written once, in its :class:`~.spec.Layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .spec import Architecture, UnsupportedModel


@dataclass
class LayerModules:
    attn: torch.nn.Module
    mlp: torch.nn.Module
    qkv: list[torch.nn.Module]  # concatenated along the output: [q | k | v]
    o: torch.nn.Module
    gate_up: list[torch.nn.Module]  # [gate | up]
    down: torch.nn.Module
    attn_norm: torch.nn.Module
    attn_out_norm: torch.nn.Module | None
    mlp_norm: torch.nn.Module
    mlp_out_norm: torch.nn.Module | None
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    act: Callable[[torch.Tensor], torch.Tensor]


def _get(owner: Any, name: str | None) -> Any:
    return None if name is None else getattr(owner, name)


def layer_modules(model: Any, arch: Architecture, index: int) -> LayerModules:
    layer = model.model.layers[index]
    lay = arch.layout
    attn, mlp = layer.self_attn, layer.mlp
    return LayerModules(
        attn=attn, mlp=mlp, qkv=[getattr(attn, n) for n in lay.qkv], o=getattr(attn, lay.o),
        gate_up=[getattr(mlp, n) for n in lay.gate_up], down=getattr(mlp, lay.down),
        attn_norm=getattr(layer, lay.attn_norm), attn_out_norm=_get(layer, lay.attn_out_norm),
        mlp_norm=getattr(layer, lay.mlp_norm), mlp_out_norm=_get(layer, lay.mlp_out_norm),
        q_norm=_get(attn, lay.q_norm), k_norm=_get(attn, lay.k_norm),
        act=getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn"),
    )


def norm_eps(module: torch.nn.Module) -> float:
    eps = getattr(module, "variance_epsilon", None)
    return float(eps if eps is not None else module.eps)


def norm_weight(module: torch.nn.Module, arch: Architecture) -> torch.Tensor:
    """The vector an RMSNorm's normalised input is multiplied by: its weight, or (Gemma) ``1 + weight`` in fp32
    as transformers computes it."""
    weight = module.weight.detach()
    return weight if not arch.norm_offset else (arch.norm_offset + weight.float()).contiguous()


def rotary_tables(model: Any, arch: Architecture, x: torch.Tensor,
                  positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin ``[1, n, rotary_dim]`` of ``positions`` (``[1, n]``) for each rotary group, by the model's own rotary
    module (``x`` gives the dtype and device)."""
    rotary = model.model.rotary_emb
    if not arch.per_layer_rope:
        return {"": rotary(x, positions)}
    return {group: rotary(x, positions, group) for group, _ in arch.ropes}


def inv_freq(model: Any, arch: Architecture, group: str = "") -> torch.Tensor:
    rotary = model.model.rotary_emb
    return getattr(rotary, f"{group}_inv_freq" if group else "inv_freq")


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """transformers' final logit soft-capping (Gemma 2), in its order and the logits' dtype; no-op without a cap."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


def verify(model: Any, arch: Architecture) -> None:
    """The declaration agrees with the transformers modules it was loaded into (``UnsupportedModel`` when a
    transformers version wires them otherwise: never run a model against a wrong description)."""
    name = type(model).__name__
    layers = model.model.layers
    if len(layers) != arch.num_layers:
        raise UnsupportedModel(f"{name}: {len(layers)} layers, the config says {arch.num_layers}")
    for i in range(arch.num_layers):
        try:
            mods = layer_modules(model, arch, i)
        except AttributeError as exc:
            raise UnsupportedModel(f"{name} layer {i} does not have the {arch.family} layout: {exc}") from None
        attn = mods.attn
        scaling = getattr(attn, "scaling", arch.query_scale)
        if abs(float(scaling) - arch.query_scale) > 1e-12 * arch.query_scale:
            raise UnsupportedModel(f"{name} layer {i}: attention scaling {scaling}, expected {arch.query_scale}")
        if hasattr(attn, "sliding_window"):
            window = attn.sliding_window if attn.sliding_window and attn.sliding_window < arch.max_context else None
            if window != arch.windows[i]:
                raise UnsupportedModel(f"{name} layer {i}: sliding window {attn.sliding_window}, expected "
                                       f"{arch.windows[i]}")
        softcap = getattr(attn, "attn_logit_softcapping", None) or None
        if softcap != arch.attn_softcap:
            raise UnsupportedModel(f"{name} layer {i}: attention soft-capping {softcap}, expected {arch.attn_softcap}")
        widths = sum(m.out_features for m in mods.qkv)
        expected = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
        if widths != expected:
            raise UnsupportedModel(f"{name} layer {i}: q/k/v projections give {widths} outputs, expected {expected}")
    embed_scale = getattr(model.model.embed_tokens, "scalar_embed_scale", None)
    if (embed_scale or None) != (arch.embed_scale or None) and not (
            embed_scale and arch.embed_scale and abs(embed_scale - arch.embed_scale) < 1e-9 * embed_scale):
        raise UnsupportedModel(f"{name}: embedding scale {embed_scale}, expected {arch.embed_scale}")
