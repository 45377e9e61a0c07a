"""The engine's event ring: what each request, eviction and prefetch did, for timelines.

:class:`EventRing` keeps the last ``capacity`` :class:`~kvbaton.types.Event` records with monotonic
sequence numbers (from 1), thread safe; ``since(seq)`` pages through it and says how many events a
slow reader lost to the bound. The engine's parts are given what they emit through when they are
built: the lifecycle the ring (requests), the radix cache and the prefetcher a :class:`CacheEvents`
(evictions, prefetches); filtering by tenant is the server's business (``server/state.py``), as for
stats.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
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


class CacheEvents:
    """What the prefix cache and the prefetcher tell the ring: each eviction round and each agent's
    blocks brought back, with the steps-to-execution the hints gave the agents concerned (``ste``, the
    engine's live map, read under the engine lock by the caller); and, to ``blocks_dropped`` (the span
    index's views of cached blocks), every device block the cache lets go."""

    def __init__(
        self, ring: EventRing, ste: Mapping[str, float], blocks_dropped: Callable[[Sequence[int]], None] | None = None,
    ) -> None:
        self.ring = ring
        self._ste = ste
        self._blocks_dropped = blocks_dropped

    def dropped(self, blocks: Sequence[int]) -> None:
        """The cache no longer holds these device blocks (evicted, offloaded, flushed): their ids may be
        handed out again for other tokens (called under the engine lock, before the pool sees them freed)."""
        if self._blocks_dropped is not None and blocks:
            self._blocks_dropped(blocks)

    def evicted(self, owners: Iterable[str], blocks: int, tier: str, policy: str) -> None:
        """``blocks`` evicted to ``tier`` (``"dropped"``: to none), nodes of ``owners``' fixed prompts among them."""
        self.ring.emit("evict", blocks=blocks, tier=tier, policy=policy, steps_to_execution=ste_of(owners, self._ste))

    def prefetched(self, agent: str, loaded: Mapping[str, int]) -> None:
        """``agent``'s blocks brought back, per tier they came from."""
        for tier, blocks in loaded.items():
            self.ring.emit("prefetch", agent=agent, blocks=blocks, tier=tier)


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
