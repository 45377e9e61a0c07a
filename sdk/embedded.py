"""The embedded clients: the engine runs in this process.

:class:`EmbeddedClient` is :class:`~kvbaton.Client` over an in-process engine (kvbaton's
:class:`~kvbaton.backend.Engine` by default, or any other :class:`~kvbaton.ops.KVOps` such as a
multi-device ``Cluster``). :class:`AsyncEmbeddedClient` is :class:`~kvbaton.AsyncClient` over the
same engine through :class:`~kvbaton.threaded.ThreadedOps`, which runs every blocking operator in a
worker thread.

Ownership: an engine the client built is closed with the client; an engine passed in belongs to
the caller.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Self

from .client import AsyncClient, Client
from .ops import KVOps
from .threaded import ThreadedOps, run_blocking, threaded

__all__ = ["AsyncEmbeddedClient", "EmbeddedClient", "ThreadedOps"]


class EmbeddedClient(Client):
    """A client over an in-process engine: ``engine`` (any :class:`~kvbaton.ops.KVOps`), or a new
    :class:`kvbaton.backend.Engine` of ``model`` with ``engine_options``."""

    def __init__(self, model: str | None = None, *, engine: KVOps | None = None, **engine_options: Any) -> None:
        self._owns_engine = engine is None
        if engine is None:
            from kvbaton.backend.engine import Engine

            engine = Engine(model, **engine_options)
        super().__init__(engine)

    @property
    def engine(self) -> Any:
        """The engine behind this client (the same object as ``ops``)."""
        return self.ops

    def close(self) -> None:
        if self._owns_engine:
            self._owns_engine = False
            self.ops.close()


class AsyncEmbeddedClient(AsyncClient):
    """:class:`EmbeddedClient` with coroutines: each call runs in a worker thread."""

    sync_client: ClassVar[type[EmbeddedClient]] = EmbeddedClient
    """What :meth:`start` builds."""

    def __init__(
        self, model: str | None = None, *, client: EmbeddedClient | None = None, engine: KVOps | None = None,
        **engine_options: Any,
    ) -> None:
        self.client = client if client is not None else self.sync_client(model, engine=engine, **engine_options)
        # The sync client, not its engine: a subclass's overrides (a scripted or spying client) hold here too.
        super().__init__(threaded(self.client))

    @classmethod
    async def start(cls, model: str | None = None, **options: Any) -> Self:
        """A client whose engine is built in a worker thread (loading a model blocks)."""
        return cls(client=await run_blocking(functools.partial(cls.sync_client, model, **options)))

    @property
    def engine(self) -> Any:
        return self.client.engine

    async def close(self) -> None:
        await self.ops.close()
