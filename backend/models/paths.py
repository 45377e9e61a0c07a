"""Which compute path runs which architecture: each path names the features (``Architecture.features``) it
implements, and refuses, saying which, any architecture that needs more. The paths ask here before they run a
model (a refused path falls back to one that runs it exactly, logged once), and the docs table is generated
from the same sets (``python -m kvbaton.backend.models --docs``), so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbaton.errors import ModelNotFound

from .spec import SHIFTABLE_ROPE, Architecture

ALL = frozenset({
    "fused_weights", "qk_norm", "offset_norm", "sandwich_norms", "activation", "mlp_bias", "attn_softcap",
    "final_softcap", "embed_scale", "sliding_window", "per_layer_rope", "partial_rotary",
})
# Head sizes kvbaton's C++ attention kernels are compiled for (csrc/*.cpp dispatch on them);
# other head sizes run the generic path (the same step in torch ops).
KERNEL_HEAD_DIMS = (64, 96, 128, 256)

_FEATURE_NAMES = {
    "fused_weights": "fused q/k/v or gate/up weights", "qk_norm": "q/k norms", "offset_norm": "(1 + weight) norms",
    "sandwich_norms": "post-attention/post-MLP norms", "activation": "a gate activation other than SiLU",
    "mlp_bias": "MLP biases", "attn_softcap": "attention soft-capping", "final_softcap": "logit soft-capping",
    "embed_scale": "scaled embeddings", "sliding_window": "sliding-window attention",
    "per_layer_rope": "per-layer rotary tables", "partial_rotary": "partial rotary embeddings",
}


@dataclass(frozen=True)
class Path:
    name: str
    title: str
    supports: frozenset[str]

    def refusal(self, arch: Architecture) -> str | None:
        """Why this path cannot run ``arch`` exactly (None: it can)."""
        missing = sorted(arch.features - self.supports)
        if missing:
            return f"{self.title} does not implement {', '.join(_FEATURE_NAMES[m] for m in missing)}"
        return None


EAGER = Path("eager", "the eager runner", ALL)  # transformers' modules with kvbaton's paged attention
FUSED_DECODE = Path("fused_decode", "the fused decode step", ALL)  # its torch ops; the C++ set: KERNELS
KERNELS = Path("kernels", "kvbaton's C++ kernels", ALL - {"partial_rotary"})
FUSED_PREFILL = Path("fused_prefill", "the fused CPU prefill", ALL - {"partial_rotary"})
CUDA_GRAPHS = Path("cuda_graphs", "the CUDA graph runner", frozenset())
SHIFT = Path("shift", "RoPE re-alignment", ALL - {"per_layer_rope"})

PATHS = {p.name: p for p in (EAGER, FUSED_DECODE, KERNELS, FUSED_PREFILL, CUDA_GRAPHS, SHIFT)}


def kernel_refusal(arch: Architecture) -> str | None:
    """Why kvbaton's C++ kernels do not run ``arch`` (features or shapes); None when they do."""
    reason = KERNELS.refusal(arch)
    if reason is not None:
        return reason
    if arch.head_dim not in KERNEL_HEAD_DIMS:
        return f"head_dim {arch.head_dim} is not one of {', '.join(map(str, KERNEL_HEAD_DIMS))}"
    if arch.intermediate_size % 16:
        return "intermediate_size must be a multiple of 16"
    if arch.hidden_size % 2:  # bf16 weights are packed in pairs along the input
        return "hidden_size must be even"
    return None


def shift_refusal(arch: Architecture) -> str | None:
    """Why keys of ``arch`` cannot be re-aligned to other positions exactly (None: they can)."""
    reason = SHIFT.refusal(arch)
    if reason is not None:
        return reason
    bad = sorted({r.type for r in arch.rope.values()} - SHIFTABLE_ROPE)
    if bad:
        allowed = ", ".join(sorted(SHIFTABLE_ROPE))
        return f"RoPE type {', '.join(map(repr, bad))} is not shifted exactly (only {allowed})"
    return None


def model_refusal(path: Path, model: Any, arch: Architecture | None = None) -> str | None:
    """Why ``path`` cannot run a loaded model (its registry architecture, read from its config when not given):
    a model the registry does not know is refused with the registry's reason."""
    if arch is None:
        from . import architecture_of

        try:
            arch = architecture_of(model)
        except ModelNotFound as exc:
            return str(exc)
    return path.refusal(arch)
