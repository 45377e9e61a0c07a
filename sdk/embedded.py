"""The embedded clients: the engine runs in this process.

:class:`EmbeddedClient` is :class:`~kvbaton.Client` over an in-process engine (kvbaton's
:class:`~kvbaton.backend.Engine` by default, or any other :class:`~kvbaton.ops.KVOps` such as a
multi-device ``Cluster``). :class:`AsyncEmbeddedClient` is :class:`~kvbaton.AsyncClient` over the
same engine through :class:`ThreadedOps`, which runs every blocking operator in a worker thread.

Ownership: an engine the client built is closed with the client; an engine passed in belongs to
the caller.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

import anyio

from .client import AsyncClient, Client
from .ops import OPERATORS, STREAM_OPERATORS, KVOps
from .stream import AsyncTokenStream, TokenStream


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


_END = object()


def async_stream(stream: TokenStream) -> AsyncTokenStream:
    """A blocking stream consumed from worker threads, one step per ``await``."""

    async def items() -> AsyncGenerator[Any, None]:
        try:
            while True:
                # anyio (not asyncio.to_thread): a cancelled await waits for the step in flight, so
                # the close below never meets a running generator.
                chunk = await anyio.to_thread.run_sync(next, stream, _END)
                if chunk is _END:
                    break
                yield chunk
            assert stream.result is not None
            yield stream.result
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stream.close)

    return AsyncTokenStream(items())


def _threaded(name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    if name in STREAM_OPERATORS:

        async def open_stream(self: ThreadedOps, *args: Any, **kwargs: Any) -> AsyncTokenStream:
            return async_stream(await asyncio.to_thread(getattr(self.sync, name), *args, **kwargs))

        return open_stream

    async def call(self: ThreadedOps, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(functools.partial(getattr(self.sync, name), *args, **kwargs))

    return call


class ThreadedOps:
    """The asynchronous twin of a blocking :class:`~kvbaton.ops.KVOps`: each operator runs in a
    worker thread (``asyncio.to_thread``) so the event loop never waits on the model; streams are
    pulled one step per worker call. Generated from :data:`~kvbaton.ops.OPERATORS`, so a new
    operator needs no edit here."""

    def __init__(self, sync: KVOps) -> None:
        self.sync = sync

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)


for _name in OPERATORS:
    setattr(ThreadedOps, _name, _threaded(_name))


class AsyncEmbeddedClient(AsyncClient):
    """:class:`EmbeddedClient` with coroutines: each call runs in a worker thread."""

    def __init__(
        self, model: str | None = None, *, client: EmbeddedClient | None = None, engine: KVOps | None = None,
        **engine_options: Any,
    ) -> None:
        self.client = client if client is not None else EmbeddedClient(model, engine=engine, **engine_options)
        # The sync client, not its engine: a subclass's overrides (a scripted or spying client) hold here too.
        super().__init__(ThreadedOps(self.client))

    @property
    def engine(self) -> Any:
        return self.client.engine

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)
