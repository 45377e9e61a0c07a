"""The engine's event ring: what each request, eviction and prefetch did, for timelines.

:class:`EventRing` keeps the last ``capacity`` :class:`~kvbaton.types.Event` records with monotonic
sequence numbers (from 1), thread safe; ``since(seq)`` pages through it and says how many events a
slow reader lost to the bound. The engine's parts emit through thin hooks (``lifecycle`` for
requests, the radix cache for evictions, the prefetcher for prefetches); filtering by tenant is the
server's business (``server/state.py``), as for stats.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from kvbaton.errors import InvalidRequest
from kvbaton.types import Event, Events

DEFAULT_CAPACITY = 4096
MAX_PAGE = 4096


class EventRing:
    """A bounded, thread-safe log of events with monotonic sequence numbers."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise InvalidRequest(f"the event ring needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._events: deque[Event] = deque(maxlen=capacity)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()  # a leaf lock: taken under the engine lock, never the other way

    def emit(self, kind: str, **fields: Any) -> Event:
        """Record an event now (``fields`` as :class:`~kvbaton.types.Event`'s)."""
        fields.setdefault("time", time.time())
        with self._lock:
            event = Event(seq=next(self._seq), kind=kind, **fields)  # type: ignore[arg-type]
            self._events.append(event)
        return event

    @property
    def last(self) -> int:
        """The sequence number of the newest event (0: none yet)."""
        with self._lock:
            return self._events[-1].seq if self._events else 0

    def since(self, seq: int = 0, limit: int = MAX_PAGE) -> Events:
        """The events after ``seq`` (at most ``limit``, oldest first)."""
        check_since(seq)
        with self._lock:
            events = list(self._events)
        return page(events, seq, limit, self.capacity)


def check_since(seq: Any) -> None:
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise InvalidRequest(f"since must be an integer >= 0, got {seq!r}")


def page(events: Iterable[Event], seq: int, limit: int, capacity: int) -> Events:
    """The :class:`Events` page after ``seq`` of ``events`` (ascending ``seq``)."""
    ordered = list(events)
    newest = ordered[-1].seq if ordered else seq
    oldest = ordered[0].seq if ordered else seq + 1
    after = [e for e in ordered if e.seq > seq][:limit]
    return Events(
        events=after,
        next=after[-1].seq if after else max(seq, newest),
        dropped=max(0, oldest - seq - 1),
        capacity=capacity,
    )


def ste_of(agents: Iterable[str], ste: Mapping[str, float]) -> dict[str, float | None]:
    """Agents' steps-to-execution for an event (JSON has no infinity: None means no hint)."""
    out: dict[str, float | None] = {}
    for agent in sorted(agents):
        value = ste.get(agent, math.inf)
        out[agent] = None if math.isinf(value) else value
    return out
