"""A streamed generation: iterate over chunks, then read the final result."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from types import TracebackType
from typing import Self

from .types import Result, StreamChunk


class TokenStream(Iterator[StreamChunk]):
    """Iterator of :class:`StreamChunk`; ``result`` holds the :class:`Result` once it is exhausted.

    Closing it early (``close()``, leaving a ``with`` block, or dropping it) cancels the generation
    and frees everything the request had taken.
    """

    def __init__(self, chunks: Generator[StreamChunk, None, Result]) -> None:
        self._chunks = chunks
        self.result: Result | None = None

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> StreamChunk:
        try:
            return next(self._chunks)
        except StopIteration as done:
            self.result = done.value
            raise

    def until_done(self) -> Result:
        """Consume the rest of the stream and return the final result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        self._chunks.close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncTokenStream(AsyncIterator[StreamChunk]):
    """The asynchronous :class:`TokenStream`: ``async for chunk in stream``, then ``stream.result``.

    Built on an async generator that yields :class:`StreamChunk`s and, last, the :class:`Result`.
    ``await stream.aclose()`` (or leaving ``async with``) cancels the generation early.
    """

    def __init__(self, items: AsyncGenerator[StreamChunk | Result, None]) -> None:
        self._items = items
        self.result: Result | None = None

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self.result is not None:
            raise StopAsyncIteration
        item = await self._items.__anext__()
        if isinstance(item, Result):
            self.result = item
            await self._items.aclose()
            raise StopAsyncIteration
        return item

    async def until_done(self) -> Result:
        """Consume the rest of the stream and return the final result."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def aclose(self) -> None:
        await self._items.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
