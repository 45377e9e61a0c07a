"""The model families kvbaton serves: one file per family, and this registry, the one place that knows them.

A family (``<family>.py``, a :class:`~.spec.Family`) declares how its decoder layer differs from Llama's; the
registry maps a checkpoint's ``model_type`` to it and its config to an :class:`~.spec.Architecture`, which the
loader, the CPU kernels (prefill and fused decode), the eager runner, the CUDA runner and the RoPE re-alignment
read (:mod:`.paths` says which of them run which features). Adding a family: its file, its line in
``FAMILIES`` below, its test (``tests/test_model_families.py``) and the regenerated docs table
(``python -m kvbaton.backend.models --docs``).
"""

from __future__ import annotations

from typing import Any

from kvbaton.errors import ModelNotFound

from . import gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3
from .spec import Architecture, Family, Layout, Rope, UnsupportedModel

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY, phi3.FAMILY, gemma2.FAMILY, gemma3.FAMILY,
)}
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}
# model_types with a known reason to refuse them, said instead of "unknown".
_REFUSED_TYPES = {
    "gemma3": "a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration); kvbaton serves the text-only "
              "model_type 'gemma3_text' (Gemma 3 1B, or a text model saved on its own)",
}

__all__ = ["FAMILIES", "Architecture", "Family", "Layout", "Rope", "UnsupportedModel", "architecture",
           "architecture_of", "family_of"]


def family_of(config: Any) -> Family:
    """The family of a transformers config (``ModelNotFound`` naming the model_type when kvbaton has none)."""
    model_type = getattr(config, "model_type", None)
    family = _BY_MODEL_TYPE.get(str(model_type))
    if family is None:
        why = _REFUSED_TYPES.get(str(model_type), "not a supported model family")
        raise ModelNotFound(f"model_type {model_type!r}: {why}; supported model_types: "
                            f"{', '.join(sorted(_BY_MODEL_TYPE))}")
    return family


def architecture(config: Any) -> Architecture:
    """A transformers config as kvbaton's compute paths read it (``UnsupportedModel`` naming the field that
    cannot be served exactly)."""
    return family_of(config).architecture(config)


def architecture_of(model: Any) -> Architecture:
    """The architecture of a loaded transformers model (read from its config each call: cheap)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise ModelNotFound(f"{type(model).__name__} has no transformers config: not a supported model")
    return architecture(config)
