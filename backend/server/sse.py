"""Server-sent events: the one driver behind every streaming endpoint.

``drive`` pulls token streams one step per worker-thread call (the event loop never waits on the
model) and asks a ``StreamEvents`` what to say at each point: before a stream, per chunk, after a
stream, at the end, on error. The native streams (``event: chunk``... ``event: result``), OpenAI
chat and OpenAI completions differ only in their ``StreamEvents``.

Invariants: streams are opened and primed (run to their first chunk) before the response starts,
so admission errors (pool exhausted) are still plain HTTP errors; once it has started, a failure is
reported in-band; every stream is closed at the end, also when the client goes away mid-stream
(``EventStreamResponse`` always closes its generator), which cancels the engine request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import anyio
from kvbaton.stream import TokenStream
from kvbaton.types import Result, StreamChunk
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .errors import in_band_error

# Runs a blocking call in a worker thread (``ServerState.run``).
Runner = Callable[..., Awaitable[Any]]

_END = object()


def sse(data: str, event: str | None = None) -> str:
    """One server-sent event (multi-line data is split over ``data:`` lines)."""
    head = f"event: {event}\n" if event else ""
    return head + "".join(f"data: {line}\n" for line in data.split("\n")) + "\n"


class EventStreamResponse(StreamingResponse):
    """SSE response whose event generator is always closed (so the engine request is cancelled),
    also when the client goes away mid-stream."""

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        super().__init__(
            events, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def close_all(streams: Iterable[TokenStream]) -> None:
    for s in streams:
        s.close()


def prime_all(streams: Sequence[TokenStream]) -> list[StreamChunk | None]:
    """Run fresh streams up to their first chunk (None: a stream that ended at once)."""
    return [next(s, None) for s in streams]


def open_primed(openers: Iterable[Callable[[], TokenStream]]) -> tuple[list[TokenStream], list[StreamChunk | None]]:
    """Open a stream per opener and prime them all; on any failure, close those opened and re-raise."""
    streams: list[TokenStream] = []
    try:
        for open_stream in openers:
            streams.append(open_stream())
        return streams, prime_all(streams)
    except BaseException:
        close_all(streams)
        raise


class StreamEvents:
    """What one kind of stream says at each point of :func:`drive` (SSE text, possibly nothing)."""

    def opening(self, index: int) -> list[str]:
        """Before the chunks of stream ``index``."""
        return []

    def chunk(self, index: int, chunk: StreamChunk) -> list[str]:
        raise NotImplementedError

    def closing(self, index: int, result: Result, last: bool) -> list[str]:
        """After stream ``index`` ended with ``result`` (``last``: no stream follows)."""
        return []

    def finish(self, results: list[Result]) -> list[str]:
        """After every stream; runs in a worker thread, so it may call the engine."""
        return []

    def error(self, body: dict[str, Any]) -> str:
        """An error after the response started (``body``: the one error schema)."""
        raise NotImplementedError


async def drive(
    run: Runner, streams: Sequence[TokenStream], firsts: Sequence[StreamChunk | None], events: StreamEvents
) -> AsyncIterator[str]:
    """The events of primed ``streams`` (their first chunks ``firsts``), one after the other."""
    try:
        results: list[Result] = []
        for i, (stream, item) in enumerate(zip(streams, firsts)):
            for text in events.opening(i):
                yield text
            while item is not None and item is not _END:
                for text in events.chunk(i, item):
                    yield text
                item = await run(next, stream, _END)
            assert stream.result is not None
            results.append(stream.result)
            for text in events.closing(i, stream.result, i == len(streams) - 1):
                yield text
        for text in await run(events.finish, results):
            yield text
    except Exception as exc:  # the response has started: report in-band
        yield events.error(in_band_error(exc))
    finally:
        with anyio.CancelScope(shield=True):
            for s in streams:
                await run(s.close)


def stream_response(
    run: Runner, streams: Sequence[TokenStream], firsts: Sequence[StreamChunk | None], events: StreamEvents
) -> EventStreamResponse:
    return EventStreamResponse(drive(run, streams, firsts, events))
