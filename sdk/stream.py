"""A streamed generation: iterate over chunks, then read the final result."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from types import TracebackType

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
