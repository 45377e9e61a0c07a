"""Server-sent events: the one driver behind every streaming endpoint, and who owns what a stream makes.

``StreamDriver`` pulls token streams one step per worker-thread call (the event loop never waits on
the model) and asks a ``StreamEvents`` what to say at each point: before a stream, per chunk, after a
stream, at the end, on error. The native streams (``event: chunk``... ``event: result``), OpenAI
chat and OpenAI completions differ only in their ``StreamEvents``.

Invariants: streams are opened and primed (run to their first chunk) before the response starts,
so admission errors (quota, pool exhausted) are still plain HTTP errors; once it has started, a
failure is reported in-band. Ownership, the same for every kind of stream: a stream's result handle
is recorded for the tenant the moment it exists, and the response hands the results over once
``StreamEvents.finish`` has run (retained, released or kept for the caller); a response that ends
before that (the client went away, an error) closes every stream, which cancels its engine request,
and releases every handle its streams made. ``EventStreamResponse`` runs that cleanup on every exit
path, also when the generator never started.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from kvbaton.stream import TokenStream
from kvbaton.types import Result, StreamChunk
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .errors import in_band_error

if TYPE_CHECKING:
    from .state import ServerState
    from .tenancy import Admission

# Runs a blocking call in a worker thread (``ServerState.run``).
Runner = Callable[..., Awaitable[Any]]
Streams = tuple[list[TokenStream], list[StreamChunk | None]]

_END = object()


def sse(data: str, event: str | None = None) -> str:
    """One server-sent event (multi-line data is split over ``data:`` lines)."""
    head = f"event: {event}\n" if event else ""
    return head + "".join(f"data: {line}\n" for line in data.split("\n")) + "\n"


class EventStreamResponse(StreamingResponse):
    """SSE response whose event generator is always closed and whose ``cleanup`` always runs (so
    the engine requests are cancelled and what they made is released), also when the client goes
    away mid-stream or before the first event."""

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None,
                 cleanup: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(
            events, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._events = events
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self._cleanup is not None:
                    await self._cleanup()


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


class StreamDriver:
    """One streamed response of a tenant: its primed streams, what to say, and what they made."""

    def __init__(self, state: ServerState, tenant: str, streams: Sequence[TokenStream],
                 firsts: Sequence[StreamChunk | None], events: StreamEvents, admission: Admission) -> None:
        self.state, self.tenant, self.streams, self.firsts = state, tenant, list(streams), list(firsts)
        self.spec, self.admission = events, admission
        self.handed_over = False

    async def events(self) -> AsyncIterator[str]:
        """The events of the streams, one after the other."""
        run = self.state.run
        try:
            results: list[Result] = []
            for i, (stream, item) in enumerate(zip(self.streams, self.firsts)):
                for text in self.spec.opening(i):
                    yield text
                while item is not None and item is not _END:
                    for text in self.spec.chunk(i, item):
                        yield text
                    item = await run(next, stream, _END)
                assert stream.result is not None
                self.state.record(self.tenant, [stream.result.handle])  # owned before anything more is sent
                results.append(stream.result)
                for text in self.spec.closing(i, stream.result, i == len(self.streams) - 1):
                    yield text
            texts = await run(self.spec.finish, results)
            self.handed_over = True
            for text in texts:
                yield text
        except Exception as exc:  # the response has started: report in-band
            yield self.spec.error(in_band_error(exc, self.state.healthy))

    def settle(self) -> None:
        """Close every stream; unless the results were handed over, release every handle the streams
        made (a result that appeared while the response was being cancelled included)."""
        try:
            close_all(self.streams)
            if not self.handed_over:
                made = [s.result.handle for s in self.streams if s.result is not None]
                self.state.record(self.tenant, made, durable=False)  # released next: nothing to journal
                self.state.release_quietly([h.id for h in made])
        finally:
            self.admission.close()

    async def cleanup(self) -> None:
        await self.state.run(self.settle)


async def stream_response(state: ServerState, tenant: str, open_streams: Callable[[], Streams],
                          events: StreamEvents, admission: Admission) -> EventStreamResponse:
    """Open and prime the streams (in a worker thread) and answer with their events; ``admission``
    (the tenant's quota for what they make) closes when the response is done, or now on failure."""
    try:
        streams, firsts = await state.run(open_streams)
    except BaseException:
        admission.close()
        raise
    driver = StreamDriver(state, tenant, streams, firsts, events, admission)
    return EventStreamResponse(driver.events(), cleanup=driver.cleanup)
