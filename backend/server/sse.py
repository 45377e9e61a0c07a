"""Server-sent events: the one driver behind every streaming endpoint, and who owns what a stream makes.

``StreamDriver`` pulls token streams one step per worker-thread call (the event loop never waits on
the model) and asks a ``StreamEvents`` what to say at each point: before a stream, per chunk, after a
stream, at the end, on error. The native streams (``event: chunk``... ``event: result``), OpenAI
chat and OpenAI completions differ only in their ``StreamEvents``. The streams of one response (an
OpenAI request's choices) are pulled in rounds (:func:`rounds`): every live stream's next chunk at
once, one worker call each, so the engine batches their steps, and their chunks are said in the
order they come, interleaved. A whole (not streamed) answer runs the same rounds (:func:`run_whole`).

Invariants: a server that drains (``ServerState.draining``, on SIGTERM) ends every generation at its
next round with ``ServerUnavailable`` (in-band once a stream has started), so none is cancelled
mid-answer; streams are opened and primed (run to their first chunk) before the response starts,
so admission errors (quota, pool exhausted) are still plain HTTP errors; once it has started, a
failure is reported in-band. Ownership, the same for every kind of stream: a stream's result handle
is recorded for the tenant the moment it exists, and the response hands the results over once
``StreamEvents.finish`` has run (retained, released or kept for the caller); a response that ends
before that (the client went away, an error) closes every stream, which cancels its engine request,
and releases every handle its streams made. ``EventStreamResponse`` runs that cleanup on every exit
path, also when the generator never started.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from kvbaton.errors import ServerUnavailable
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
T = TypeVar("T")

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
                 cleanup: Callable[[], Awaitable[None]] | None = None,
                 closed: Callable[[], None] | None = None) -> None:
        super().__init__(
            events, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._events = events
        self._cleanup = cleanup
        self._closed = closed  # called once the response ends (stops counting it among the open streams)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
                try:
                    if self._cleanup is not None:
                        await self._cleanup()
                finally:
                    if self._closed is not None:
                        self._closed()


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


async def run_each(run: Runner, calls: Sequence[Callable[[], T]]) -> list[T]:
    """Every call at once, each in its own worker call (so the engine batches their model steps);
    their values in order. A failure is raised once every call has returned (a worker thread cannot
    be cancelled), as itself when it is the only one."""
    out: list[Any] = [None] * len(calls)

    async def one(k: int, call: Callable[[], T]) -> None:
        out[k] = await run(call)

    try:
        async with anyio.create_task_group() as tasks:
            for k, call in enumerate(calls):
                tasks.start_soon(one, k, call)
    except BaseExceptionGroup as group:
        raise only_error(group) from None
    return out


@dataclass(frozen=True)
class Ended:
    """A stream's end, with its result."""

    result: Result


class ClientGone(Exception):
    """The client of a whole (not streamed) answer went away: its generation stops (nothing is sent)."""


async def rounds(state: ServerState, streams: Sequence[TokenStream], firsts: Sequence[StreamChunk | None],
                 gone: Callable[[], bool] | None = None) -> AsyncIterator[tuple[int, StreamChunk | Ended]]:
    """What primed ``streams`` (their first chunks ``firsts``) say, in rounds: each round, every live
    stream's next chunk, pulled at once (one worker call each, so the engine batches their steps), is
    given in stream order, then each stream that ended, as :class:`Ended`. A server that is shutting
    down (``state.draining``) ends them at the next round with ``ServerUnavailable``; a client that is
    ``gone`` ends them with :class:`ClientGone`."""
    items: dict[int, StreamChunk | object | None] = dict(enumerate(firsts))
    live = list(range(len(streams)))
    while live:
        for i in live:
            item = items[i]
            if isinstance(item, StreamChunk):
                yield i, item
        ended = [i for i in live if not isinstance(items[i], StreamChunk)]
        live = [i for i in live if i not in ended]
        for i in ended:
            result = streams[i].result
            assert result is not None
            yield i, Ended(result)
        if live:
            if state.draining:
                raise ServerUnavailable("the server is shutting down: this generation ends here; retry when it is "
                                        "back")
            if gone is not None and gone():
                raise ClientGone("the client went away")
            pulls = [functools.partial(next, streams[i], _END) for i in live]
            items.update(zip(live, await run_each(state.run, pulls)))


async def run_whole(state: ServerState, open_streams: Callable[[], Streams],
                    gone: Callable[[], bool] | None = None) -> list[Result]:
    """A whole (not streamed) answer's generations: the streams ``open_streams`` opens and primes (in
    a worker thread), run to their ends at once (:func:`rounds`); their results in order. On any
    failure (or cancellation, or the client ``gone``) every stream is closed and what the ended ones
    made is released."""
    streams, firsts = await state.run(open_streams)
    results: dict[int, Result] = {}
    try:
        async for i, item in rounds(state, streams, firsts, gone):
            if isinstance(item, Ended):
                results[i] = item.result
    except BaseException:
        with anyio.CancelScope(shield=True):
            await state.run(_abandon, state, streams)
        raise
    return [results[i] for i in range(len(streams))]


def _abandon(state: ServerState, streams: Sequence[TokenStream]) -> None:
    close_all(streams)
    state.release_quietly([s.result.handle.id for s in streams if s.result is not None])


def only_error(exc: BaseException) -> BaseException:
    """The one error inside an exception group (of concurrent calls), else the group itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class StreamEvents:
    """What one kind of stream says at each point of :func:`drive` (SSE text, possibly nothing)."""

    def opening(self, index: int) -> list[str]:
        """Before the chunks of stream ``index``."""
        return []

    def chunk(self, index: int, chunk: StreamChunk) -> list[str]:
        raise NotImplementedError

    def closing(self, index: int, result: Result, last: bool) -> list[str]:
        """After stream ``index`` ended with ``result`` (``last``: it is the last of them to end)."""
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
                 firsts: Sequence[StreamChunk | None], events: StreamEvents, admission: Admission,
                 closed: Callable[[], None] = lambda: None) -> None:
        self.state, self.tenant, self.streams, self.firsts = state, tenant, list(streams), list(firsts)
        self.spec, self.admission, self.closed = events, admission, closed
        self.handed_over = False

    def generated(self) -> None:
        """Every stream ended and what they made is the tenant's: the response stops counting among the
        tenant's open streams, and its admission against the tenant's quotas, before the client hears
        that it ended (a client that starts its next stream then is not refused for this one)."""
        self.closed()
        self.admission.close()

    async def events(self) -> AsyncIterator[str]:
        """The events of the streams, interleaved as their chunks come: every live stream is pulled
        at once (one worker call each, so the engine batches their steps), and what each has is said
        in stream order, round after round."""
        try:
            for i in range(len(self.streams)):
                for text in self.spec.opening(i):
                    yield text
            results: dict[int, Result] = {}
            async for i, item in rounds(self.state, self.streams, self.firsts):
                if isinstance(item, StreamChunk):
                    for text in self.spec.chunk(i, item):
                        yield text
                    continue
                await self.state.recorded(self.tenant, [item.result.handle])  # owned before anything more is sent
                results[i] = item.result
                if len(results) == len(self.streams):
                    self.generated()
                for text in self.spec.closing(i, item.result, len(results) == len(self.streams)):
                    yield text
            texts = await self.state.run(self.spec.finish, [results[i] for i in range(len(self.streams))])
            self.handed_over = True
            for text in texts:
                yield text
        except Exception as exc:  # the response has started: report in-band
            yield self.spec.error(in_band_error(only_error(exc), self.state.healthy))

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
    (the tenant's quota for what they make) closes when the response is done, or now on failure.
    The response counts as one of the tenant's open streams (429 at once beyond its limit)."""
    try:
        closed = state.concurrency.open_stream(tenant)
    except BaseException:
        admission.close()
        raise
    try:
        streams, firsts = await state.run(open_streams)
    except BaseException:
        closed()
        admission.close()
        raise
    driver = StreamDriver(state, tenant, streams, firsts, events, admission, closed)
    return EventStreamResponse(driver.events(), cleanup=driver.cleanup, closed=closed)
