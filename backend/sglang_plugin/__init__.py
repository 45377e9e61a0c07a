"""kvbaton's workflow-aware KV cache inside SGLang 0.5.23 (docs/sglang.md).

SGLang loads :func:`register` through the ``sglang.srt.plugins`` entry point in each of its
processes. It adds the ``kvbaton`` radix eviction policy (steps-to-execution order, on the Python
tree core), reads kvbaton hints from requests' ``kv_hints`` and from a scheduler RPC, and prefetches
host-tier KV of agents due soon. See docs/sglang.md.

Nothing here imports SGLang until :func:`register` runs, so ``kvbaton`` never needs it.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point."""
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        # Internals this plugin hooks change between 0.5.x releases: refuse rather than misbehave.
        raise RuntimeError(f"the kvbaton plugin supports sglang=={SGLANG_VERSION}, found {sglang.__version__}")
    from .hooks import install

    install()


__all__ = ["SGLANG_VERSION", "register"]
