"""Streams that survive their worker: a generation recomputed on another worker when its actor dies.

The chunks come from the worker's Ray streaming generator straight to the reader (:mod:`.remote`).
When the actor dies mid-stream, the request is started again elsewhere (its handle recomputed from
lineage there, :mod:`.routing`) and the chunks already delivered are skipped, which gives the same
text only for deterministic sampling (greedy or seeded); a non-deterministic stream that already
produced text ends with the typed :class:`ServerUnavailable` (503: retry) instead of continuing with
different text. Nothing acknowledged is lost: a handle exists for the client only once the result
carrying it arrived. Invariant: the stream on the worker is closed whatever way the consumer leaves
(done, error, abandoned).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator

from kvbaton.errors import ServerUnavailable
from kvbaton.stream import TokenStream
from kvbaton.types import Result, SamplingParams, StreamChunk

from .remote import WorkerLost, WorkerRef

Start = Callable[[], tuple[WorkerRef, Iterator[StreamChunk | Result]]]


def recomputing_stream(params: SamplingParams, start: Start, retried: Callable[[WorkerRef], None]) -> TokenStream:
    """A stream from ``start()`` (which picks a worker and starts the request there), started again
    when that worker is lost; ``retried`` gets the worker lost before each re-run."""
    deterministic = params.temperature == 0 or params.seed is not None
    worker, items = start()

    def chunks() -> Generator[StreamChunk | None, None, Result]:
        nonlocal worker, items
        delivered = 0
        try:
            yield None  # primed below: from here on, closing the stream closes the worker's one
            while True:
                skip = delivered
                try:
                    for item in items:
                        if isinstance(item, Result):
                            return item
                        if skip:
                            skip -= 1
                            continue
                        delivered += 1
                        yield item
                except WorkerLost:
                    if delivered and not deterministic:
                        raise ServerUnavailable(
                            f"worker {worker.rank} died mid-stream; a stream with non-deterministic sampling "
                            "cannot be continued elsewhere: retry the request"
                        ) from None
                    retried(worker)
                    worker, items = start()
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    # The request runs on the worker already: a generator closed before it started would skip its
    # ``finally`` and leave that stream (and what it makes) running there with nobody to end it.
    primed = chunks()
    next(primed)
    return TokenStream(primed)  # type: ignore[arg-type]
