"""The handle table: which handle ids are live in an engine, and what a client's handle must match.

Shared by the in-process :class:`~kvbaton.backend.Engine`, the multi-device
:class:`~kvbaton.backend.cluster.Cluster` and the SGLang engine; each keeps its own kind of state
per handle (K/V blocks, the worker holding it, a token prefix).

Invariants:

- an id is live (in the table) or was released (remembered in a bounded memory, so a late user
  gets :class:`HandleReleased`, not :class:`HandleNotFound`), never both;
- a :class:`~kvbaton.Handle` object is checked against the engine's :class:`Identity` before its
  id is used: a handle of another model, tokenizer or positional layout is
  :class:`IncompatibleHandle`, whatever its id;
- release is all or nothing: every id is checked before any is removed.

The table has its own lock, so it is safe on its own; engines that must read a state and act on
it atomically (the K/V of a handle being released meanwhile) still hold their own lock around both.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvbaton.errors import HandleNotFound, HandleReleased, IncompatibleHandle, InvalidRequest
from kvbaton.handle import Handle, HandleLike, LineageStep, Placement, Positions

S = TypeVar("S")

RELEASED_MEMORY = 1_000_000  # remembered released ids


@dataclass(frozen=True)
class Identity:
    """What a handle must match to be used here, and what the handles made here carry.

    ``None`` fields are not checked (a cluster coordinator knows only the model fingerprint);
    :meth:`handle` needs all of them.
    """

    model: str
    fingerprint: str
    tokenizer_fingerprint: str | None = None
    positions: Positions | None = None
    placement: Placement | None = None
    runs: str = ""  # how the engine describes what it runs, for the mismatch message
    where: str = "this engine"

    def check(self, handle: Handle) -> None:
        if handle.model_fingerprint != self.fingerprint:
            raise IncompatibleHandle(
                f"handle {handle.id} was made by model {handle.model!r} (fingerprint {handle.model_fingerprint}); "
                f"{self.where} runs {self.runs or repr(self.model)} (fingerprint {self.fingerprint})"
            )
        if self.tokenizer_fingerprint is not None and handle.tokenizer_fingerprint != self.tokenizer_fingerprint:
            raise IncompatibleHandle(f"handle {handle.id} was tokenized by a different tokenizer")
        if self.positions is not None and handle.positions != self.positions:
            raise IncompatibleHandle(
                f"handle {handle.id} has positional layout {handle.positions.model_dump()}, "
                f"{self.where} needs {self.positions.model_dump()}"
            )

    def handle(
        self, handle_id: str, num_tokens: int, lineage: tuple[LineageStep, ...], *, exact: bool = True
    ) -> Handle:
        """The public handle of a state made here."""
        assert self.tokenizer_fingerprint is not None and self.positions is not None and self.placement is not None
        return Handle(
            id=handle_id, model=self.model, model_fingerprint=self.fingerprint,
            tokenizer_fingerprint=self.tokenizer_fingerprint, num_tokens=num_tokens, positions=self.positions,
            lineage=lineage, placement=self.placement, exact=exact,
        )


def handle_id(handle: HandleLike, identity: Identity | None) -> str:
    """The id of a handle or id, after the compatibility check of a handle object against ``identity``
    (None: no check)."""
    if isinstance(handle, Handle):
        if identity is not None:
            identity.check(handle)
        return handle.id
    if isinstance(handle, str):
        return handle
    raise InvalidRequest(f"expected a Handle or a handle id, got {type(handle).__name__}")


class HandleTable(Generic[S]):
    """Live states by handle id, plus the memory of released ids."""

    def __init__(self, identity: Identity | None = None, *, memory: int = RELEASED_MEMORY) -> None:
        self.identity = identity  # set later by engines that learn it after start-up (a cluster)
        self._live: dict[str, S] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        self._memory = memory
        self._lock = threading.Lock()

    def id_of(self, handle: HandleLike) -> str:
        """The id of a handle or id, after the compatibility check of a handle object."""
        return handle_id(handle, self.identity)

    def get(self, handle: HandleLike) -> S:
        """The live state of a handle or id, or the typed error saying why there is none."""
        handle_id = self.id_of(handle)
        with self._lock:
            state = self._live.get(handle_id)
            if state is not None:
                return state
            released = handle_id in self._released
        if released:
            raise HandleReleased(f"handle {handle_id} was released")
        raise HandleNotFound(f"no handle {handle_id} in this engine")

    def find(self, handle_id: str) -> S | None:
        """The live state of an id, or None (no error: for bookkeeping that may meet either)."""
        with self._lock:
            return self._live.get(handle_id)

    def add(self, handle_id: str, state: S) -> None:
        with self._lock:
            self._live[handle_id] = state
            self._released.pop(handle_id, None)  # an adopted handle lives again

    def discard(self, handle_id: str) -> S | None:
        """Forget a live id without remembering it as released (a state that never went public)."""
        with self._lock:
            return self._live.pop(handle_id, None)

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> list[tuple[str, S]]:
        """Remove every handle (all or nothing) and remember the ids; their states, in order."""
        items = [handles] if isinstance(handles, Handle | str) else list(handles)
        ids = [self.id_of(h) for h in items]
        for handle_id in ids:
            self.get(handle_id)
        if len(set(ids)) != len(ids):
            raise InvalidRequest("the same handle is listed twice")
        with self._lock:
            out = []
            for handle_id in ids:
                state = self._live.pop(handle_id, None)
                if state is None:  # released concurrently: already gone
                    continue
                out.append((handle_id, state))
                self._released[handle_id] = None
                if len(self._released) > self._memory:
                    self._released.popitem(last=False)
            return out

    def __contains__(self, handle_id: object) -> bool:
        with self._lock:
            return handle_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def states(self) -> list[S]:
        with self._lock:
            return list(self._live.values())

    def items(self) -> Iterator[tuple[str, S]]:
        with self._lock:
            return iter(list(self._live.items()))
