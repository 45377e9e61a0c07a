"""The one bridge from blocking code to the event loop: blocking calls and streams in worker threads.

:class:`ThreadedOps` is the asynchronous twin of any blocking :class:`~kvbaton.ops.KVOps` (an
engine, a cluster, a synchronous client): each operator runs in a worker thread, so the event loop
never waits on the model, and streams are pulled one step per worker call. :func:`threaded` gives it
the type it implements, :class:`~kvbaton.ops.AsyncKVOps`. :func:`run_blocking` (one call) and
:func:`async_stream` (one stream) are what it is built on, and what every other piece of async code
that holds something blocking (the scopes, the adapters) uses too.

Invariants: a call runs with the caller's context (``contextvars``: the active ownership scopes
follow it into the thread); a cancelled stream step is waited for before the stream is closed, so
the close never meets a running generator.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import anyio

from .ops import OPERATORS, STREAM_OPERATORS, AsyncKVOps, KVOps
from .stream import AsyncTokenStream, TokenStream
from .types import Result, StreamChunk

P = ParamSpec("P")
T = TypeVar("T")

async def run_blocking(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` in a worker thread, with the caller's context."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def async_stream(stream: TokenStream) -> AsyncTokenStream:
    """A blocking stream consumed from worker threads, one step per ``await``."""

    async def items() -> AsyncGenerator[StreamChunk | Result, None]:
        try:
            while True:
                # anyio (not asyncio.to_thread): a cancelled await waits for the step in flight, so
                # the close below never meets a running generator.
                chunk: StreamChunk | None = await anyio.to_thread.run_sync(next, stream, None)
                if chunk is None:
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
            return async_stream(await run_blocking(getattr(self.sync, name), *args, **kwargs))

        return open_stream

    async def call(self: ThreadedOps, *args: Any, **kwargs: Any) -> Any:
        return await run_blocking(functools.partial(getattr(self.sync, name), *args, **kwargs))

    return call


class ThreadedOps:
    """The asynchronous twin of a blocking :class:`~kvbaton.ops.KVOps` (see the module docstring).
    Generated from :data:`~kvbaton.ops.OPERATORS`, so a new operator needs no edit here;
    :func:`threaded` is the typed way to make one."""

    def __init__(self, sync: KVOps) -> None:
        self.sync = sync

    async def close(self) -> None:
        await run_blocking(self.sync.close)


for _name in OPERATORS:
    setattr(ThreadedOps, _name, _threaded(_name))


def threaded(sync: KVOps) -> AsyncKVOps:
    """``sync``'s operators as coroutines, each run in a worker thread."""
    ops = ThreadedOps(sync)
    if not isinstance(ops, AsyncKVOps):  # generated above from the same contract: never
        raise TypeError("ThreadedOps lacks an operator of AsyncKVOps")
    return ops

