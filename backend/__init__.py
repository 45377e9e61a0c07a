"""kvbaton's serving backend: the engine that owns the KV cache."""

from .engine import Engine
from .loader import DEFAULT_MODEL, LoadedModel, load_model

__all__ = ["DEFAULT_MODEL", "Engine", "LoadedModel", "load_model"]
