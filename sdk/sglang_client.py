"""Clients over SGLang (with the kvbaton plugin) in this process: ``kvbaton.connect(engine="sglang")``.

The same :class:`~kvbaton.Client` interface as the embedded kvbaton engine; handles are token
prefixes held in SGLang's radix tree (see :mod:`kvbaton.backend.sglang_plugin.engine` and
docs/sglang.md). Needs sglang==0.5.23 in this Python (docs/sglang.md: installing) and a GPU.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .embedded import AsyncEmbeddedClient, EmbeddedClient


def _sglang_engine(model: str | None, options: dict[str, Any]) -> Any:
    from kvbaton.backend.sglang_plugin.engine import SglangEngine

    return SglangEngine(model, **options)


class SglangClient(EmbeddedClient):
    """:class:`~kvbaton.embedded.EmbeddedClient` over an in-process SGLang engine.

    ``model`` is a local Hugging Face checkpoint dir; options: ``kv_budget`` ("4096 tokens" or a
    size), ``eviction`` ("kvbaton" or "lru"), ``lookahead``, ``host_tier_gb``, ``page_size``,
    ``dtype``, and any ``sglang.Engine`` keyword."""

    def __init__(self, model: str | None = None, *, engine: Any = None, **options: Any) -> None:
        super().__init__(engine=engine if engine is not None else _sglang_engine(model, options))
        self._owns_engine = True  # SGLang holds a GPU and its scheduler processes: always ours to end


class AsyncSglangClient(AsyncEmbeddedClient):
    """:class:`SglangClient` with coroutines (``await kvbaton.aconnect(engine="sglang", model=...)``)."""

    sync_client: ClassVar[type[EmbeddedClient]] = SglangClient

    def __init__(self, model: str | None = None, *, client: SglangClient | None = None, **options: Any) -> None:
        super().__init__(client=client if client is not None else SglangClient(model, **options))
