"""Each tenant's own view of the engine's events, with its own sequence numbers.

The engine keeps one event ring for everybody (:class:`..events.EventRing`). On a multi-tenant
server a tenant must see only its own events, and the sequence numbers it pages with must not tell
it how much the others did: :class:`EventViews` reads the engine's ring (``pump``, one reader, off
the event loop) and appends each event to the ring of the tenant it belongs to, numbered in that
ring (1, 2, 3... per tenant). Which tenant an event belongs to, and how it is shown to it, is
``route`` (the server state's: a request of the tenant's agents, by their own names; the shared
pool's evictions to every tenant, with only its own agents' steps-to-execution). On a server
without tokens the one view keeps the engine's own numbers.

Reading a view (``page``) is in memory and never calls the engine, so live event streams wait on
the event loop and take no worker thread; the server pumps on a timer and before each page it
serves. Invariants: every engine event is routed at most once (one cursor, under a lock); each
view is bounded (``capacity`` events; a reader that falls behind is told how many it lost, in its
own numbers); events the engine's ring lost before a pump read them are counted in ``lost`` (they
cannot be attributed to a tenant).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

from kvbaton.types import Event, Events

from ..events import DEFAULT_CAPACITY, MAX_PAGE, check_since, page

PUMP_INTERVAL_S = 0.25  # how often the server moves new engine events into the views (and streams look)

Route = Callable[[Event], Iterable[tuple[str, Event]]]


class _View:
    def __init__(self, capacity: int) -> None:
        self.events: deque[Event] = deque(maxlen=capacity)
        self.last = 0


class EventViews:
    """The engine's events, split into one bounded, separately numbered view per tenant."""

    def __init__(self, read: Callable[[int], Events], route: Route, renumber: bool,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self._read, self._route, self._renumber, self._capacity = read, route, renumber, capacity
        self._views: dict[str, _View] = {}
        self._cursor = 0
        self._pump_lock = threading.Lock()  # one reader of the engine's ring
        self._lock = threading.Lock()  # the views (a leaf lock)
        self.lost = 0

    def pump(self) -> None:
        """Move the engine's new events into their tenants' views (calls the engine: off the event loop)."""
        with self._pump_lock:
            while True:
                batch = self._read(self._cursor)
                self.lost += batch.dropped
                routed = [(tenant, shown) for event in batch.events for tenant, shown in self._route(event)]
                with self._lock:
                    for tenant, shown in routed:
                        view = self._views.get(tenant)
                        if view is None:
                            view = self._views[tenant] = _View(self._capacity)
                        view.last = view.last + 1 if self._renumber else shown.seq
                        view.events.append(shown.model_copy(update={"seq": view.last}) if self._renumber else shown)
                if batch.next == self._cursor or not batch.events:
                    return
                self._cursor = batch.next

    def page(self, tenant: str, since: int, limit: int = MAX_PAGE) -> Events:
        """The tenant's events after ``since`` in its own numbering (in memory: no engine call)."""
        check_since(since)
        with self._lock:
            view = self._views.get(tenant)
            if view is None:
                return Events(events=[], next=since, capacity=self._capacity)
            if view.last <= since:  # nothing new: the common case of a live stream's poll
                return Events(events=[], next=since, capacity=self._capacity)
            events = list(view.events)
        return page(events, since, limit, self._capacity)

    def last(self, tenant: str) -> int:
        with self._lock:
            view = self._views.get(tenant)
            return view.last if view is not None else 0
