"""kvbaton's serving backend: the engine that owns the KV cache."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_MODEL", "Engine", "LoadedModel", "load_model"]


def __getattr__(name: str) -> Any:
    # Lazy: importing a light submodule (kvbaton.backend.cache.eviction, or the SGLang plugin inside
    # SGLang's own processes) must not load torch, transformers and the engine.
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name in ("DEFAULT_MODEL", "LoadedModel", "load_model"):
        from .compute import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
