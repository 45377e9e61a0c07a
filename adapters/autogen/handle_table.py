"""The side table of the AutoGen adapter: which kvbaton handle produced a message.

AutoGen drops message metadata before a model client sees the messages, so each reply's handle is
kept here under ``(source agent, content)``, and a later prompt finds the handles of its messages
by their text. One table per kvbaton backend (handles only mean something to the engine that made
them), shared by every adapter client of it.

Invariant: bounded (``capacity`` entries, least recently used dropped first); a handle that falls
out is returned to the caller to release, unless another entry still holds it.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from typing import Any

from kvbaton.client import AsyncClient, Client
from kvbaton.handle import Handle


def _content_key(source: str, text: str) -> str:
    return hashlib.sha256(f"{source}\x00{text}".encode()).hexdigest()


class HandleTable:
    """``(source agent, content)`` -> the :class:`~kvbaton.Handle` of the reply that produced it.

    One table per kvbaton backend (handles only mean something to the engine that made them),
    bounded: the least recently used entries are dropped and their handles released."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Handle] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, source: str, text: str, handle: Handle) -> list[Handle]:
        """Record a reply; returns the handles that fell out of the table (to release)."""
        with self._lock:
            key = _content_key(source, text)
            old = self._items.pop(key, None)
            self._items[key] = handle
            dropped = [old] if old is not None and old.id != handle.id else []
            while len(self._items) > self.capacity:
                dropped.append(self._items.popitem(last=False)[1])
            live = {h.id for h in self._items.values()}
            return [h for h in dropped if h.id not in live]

    def get(self, source: str, text: str) -> Handle | None:
        with self._lock:
            key = _content_key(source, text)
            handle = self._items.get(key)
            if handle is not None:
                self._items.move_to_end(key)
            return handle

    def discard(self, handle_id: str) -> None:
        with self._lock:
            for key in [k for k, h in self._items.items() if h.id == handle_id]:
                del self._items[key]

    def handles(self) -> list[Handle]:
        with self._lock:
            return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)


_tables: weakref.WeakKeyDictionary[Any, HandleTable] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def handle_table(backend: Client | AsyncClient) -> HandleTable:
    """The side table shared by every adapter client of ``backend``."""
    with _tables_lock:
        table = _tables.get(backend)
        if table is None:
            table = _tables[backend] = HandleTable()
        return table


__all__ = ["HandleTable", "handle_table"]
