"""Ownership scopes: which handles a unit of work created, and releasing them when it ends.

``with client.scope() as s:`` (or ``async with``) records every handle created through ``client``
while the block runs — the results of materialize, fork, extend, resume, complete, generate (and
their streams), compose, merge and transfer — and releases, when the block ends, those that were
neither kept (``s.keep(handle)``, or ``client.keep(handle)`` for every scope) nor released already.
A :class:`Scope` made without a client (``Scope()``) records the handles of every client: the
adapters use that for a run of a wrapped app. A scope that is never entered is a plain ledger:
handles are added to it explicitly (:meth:`Scope.add`) and released by :meth:`Scope.close`.

Invariants:

- the active scopes live in a :class:`~contextvars.ContextVar`, so nested scopes, threads started
  with the context (``asyncio.to_thread``, LangChain's executors) and asyncio tasks each see their
  own; a handle is recorded in every active scope that covers its client (nested scopes: the
  innermost releases it first, a handle it keeps stays owned by the outer ones);
- a handle is released through the client that created it, once: gone handles
  (:class:`~kvbaton.HandleNotFound`, :class:`~kvbaton.HandleReleased`) are skipped, never raised;
- a handle the user kept (``client.keep``) is never released by a scope — only an explicit
  ``client.release`` frees it (and ends the keep); an id equal to one of the call's inputs (a
  transfer keeps its id) is never recorded, so a scope only owns what was created inside it;
- a closed scope records nothing more; every release is logged at debug level with its counts.

**Reuse sessions.** A scope may name a ``session`` (``Scope(session="run-7")``): the unit of work whose
requests may reuse each other's K/V approximately (``reuse="auto"`` and the like place only spans their
own session computed, ``EngineConfig.span_partition``). :func:`current_session` is the session of the
innermost active scope that names one (None: none does). Every request made inside such a scope belongs
to it: an in-process engine reads it when it takes the request's ``agent`` (and a multi-device cluster
resolves it in the calling process, before its workers see the request), and an HTTP client sends it as
``X-Kvbaton-Session`` on every request that does not carry one; the adapters open one
per run (a LangGraph invocation or thread, an AutoGen team's conversation), so a run never places spans
of an earlier, unrelated run unless the runs name the same session on purpose.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncGenerator, Generator, Iterable
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, Self, TypeVar

from .errors import HandleNotFound, HandleReleased, InvalidRequest
from .handle import Handle
from .ops import MAX_AGENT_CHARS, AsyncKVOps, is_async
from .stream import AsyncTokenStream, TokenStream
from .threaded import threaded
from .types import Composition, Result, StreamChunk

log = logging.getLogger("kvbaton.scope")
T = TypeVar("T")

GONE = (HandleNotFound, HandleReleased)
"""Errors of releasing a handle that is already gone: nothing left to free."""

_ACTIVE: ContextVar[tuple[Scope, ...]] = ContextVar("kvbaton_scopes", default=())

# ids the user kept (client.keep): no scope releases them; ids are random 128-bit, so one set serves
# every client and engine
_kept: set[str] = set()
_kept_lock = threading.Lock()


def handle_ids(out: Any) -> list[str]:
    """The ids of the handles an operator returned (a handle, handles, a result or a composition)."""
    if isinstance(out, Handle):
        return [out.id]
    if isinstance(out, str):
        return [out]
    if isinstance(out, Result | Composition):
        return [out.handle.id]
    if isinstance(out, list | tuple | set | frozenset):
        return [i for item in out for i in handle_ids(item)]
    return []


def _family(client: Any) -> set[int]:
    """``client`` and the clients it is built on (an async client's sync client, a client over
    another client): a call through any of them is a call through ``client``."""
    seen: set[int] = set()
    todo = [client]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen or len(seen) > 8:
            continue
        seen.add(id(c))
        todo.extend(getattr(c, name, None) for name in ("client", "ops", "sync"))
    return seen


def is_kept(handle_id: str) -> bool:
    with _kept_lock:
        return handle_id in _kept


def keep(handles: Any) -> None:
    """Keep ``handles`` out of every scope's release (``client.keep``)."""
    with _kept_lock:
        _kept.update(handle_ids(handles))


def active() -> tuple[Scope, ...]:
    """The scopes active in this context, outermost first."""
    return _ACTIVE.get()


def check_session(session: str | None) -> str | None:
    """``session`` as a reuse session's name (None: none); InvalidRequest unless a non-empty string of at
    most :data:`~kvbaton.ops.MAX_AGENT_CHARS` characters (what a server takes in ``X-Kvbaton-Session``)."""
    if session is not None and (not isinstance(session, str) or not session or len(session) > MAX_AGENT_CHARS):
        raise InvalidRequest(f"a session is a non-empty string of at most {MAX_AGENT_CHARS} characters, "
                             f"got {session!r}")
    return session


def current_session() -> str | None:
    """The reuse session of the innermost active scope that names one; None when none does."""
    for scope in reversed(_ACTIVE.get()):
        if scope.session is not None:
            return scope.session
    return None


def record(client: Any, out: T, *inputs: Any, via: Any = None) -> T:
    """Record the handles of ``out`` (created by ``client``) in the active scopes that cover
    ``client``, to be released through ``via`` (default: ``client``); returns ``out``. Ids of
    ``inputs`` (the call's own handles) are not recorded."""
    scopes = _ACTIVE.get()
    if scopes:
        ids = handle_ids(out)
        if inputs:
            given = set(handle_ids(list(inputs)))
            ids = [i for i in ids if i not in given]
        for scope in scopes:
            if scope.covers(client):
                scope.add(ids, via=client if via is None else via)
    return out


def released(handles: Any) -> None:
    """``handles`` (a handle, an id, or a list of them) were released explicitly: no scope owns
    them, and they are no longer kept."""
    ids = handle_ids(handles)
    with _kept_lock:
        _kept.difference_update(ids)
    for scope in _ACTIVE.get():
        scope.forget(ids)


def record_stream(client: Any, stream: TokenStream, *inputs: Any, via: Any = None) -> TokenStream:
    """``stream`` whose result handle is recorded, when it arrives, in the scopes active now."""
    scopes = _ACTIVE.get()
    if not scopes:
        return stream

    def chunks() -> Generator[StreamChunk, None, Result]:
        result: Result = yield from stream
        _record_in(scopes, client, result, inputs, via)
        return result

    return TokenStream(chunks())


def arecord_stream(client: Any, stream: AsyncTokenStream, *inputs: Any, via: Any = None) -> AsyncTokenStream:
    """:func:`record_stream` for an :class:`~kvbaton.AsyncTokenStream`."""
    scopes = _ACTIVE.get()
    if not scopes:
        return stream

    async def items() -> AsyncGenerator[StreamChunk | Result, None]:
        try:
            async for chunk in stream:
                yield chunk
            assert stream.result is not None
            _record_in(scopes, client, stream.result, inputs, via)
            yield stream.result
        finally:
            await stream.aclose()

    return AsyncTokenStream(items())


def _record_in(scopes: tuple[Scope, ...], client: Any, out: Any, inputs: tuple[Any, ...], via: Any) -> None:
    token = _ACTIVE.set(scopes)
    try:
        record(client, out, *inputs, via=via)
    finally:
        _ACTIVE.reset(token)


# -- releasing --------------------------------------------------------------------------------------


def release_quietly(client: Any, ids: list[str]) -> tuple[int, int]:
    """Release ``ids`` through a blocking ``client``, skipping those already gone; ``(released, gone)``.
    Other errors (the server is down, say) are raised."""
    try:
        if ids:
            client.release(ids)  # all or nothing: one call when none is gone
        return len(ids), 0
    except GONE:
        gone = sum(not _released_one(client, handle_id) for handle_id in ids)
    return len(ids) - gone, gone


def _released_one(client: Any, handle_id: str) -> bool:
    try:
        client.release(handle_id)
        return True
    except GONE:
        return False


async def arelease_quietly(client: Any, ids: list[str]) -> tuple[int, int]:
    """:func:`release_quietly` through any client: an asynchronous one awaited, a blocking one in
    worker threads (:func:`~kvbaton.threaded.threaded`)."""
    ops = client if is_async(client) else threaded(client)
    if not ids:
        return 0, 0
    try:
        await ops.release(ids)
        return len(ids), 0
    except GONE:
        outcomes = [await _areleased_one(ops, handle_id) for handle_id in ids]
    return outcomes.count(True), outcomes.count(False)


async def _areleased_one(ops: AsyncKVOps, handle_id: str) -> bool:
    try:
        await ops.release(handle_id)
        return True
    except GONE:
        return False


# -- the scope --------------------------------------------------------------------------------------


class Scope:
    """The handles one unit of work owns (see the module docstring). ``client``: record only the
    handles of that client (and the clients it is built on); None: of every client."""

    def __init__(self, client: Any = None, *, name: str = "scope", session: str | None = None) -> None:
        self.client = client
        self.name = name
        self.session = check_session(session)
        self.closed = False
        self._covers = None if client is None else _family(client)
        self._owned: dict[str, Any] = {}  # handle id -> the client that created it (insertion order)
        self._lock = threading.Lock()
        self._tokens: list[Token[tuple[Scope, ...]]] = []

    def __repr__(self) -> str:
        session = f", session {self.session!r}" if self.session is not None else ""
        return f"Scope({self.name!r}, owns {len(self)} handles{session}{', closed' if self.closed else ''})"

    def __len__(self) -> int:
        with self._lock:
            return len(self._owned)

    def covers(self, client: Any) -> bool:
        return self._covers is None or id(client) in self._covers

    # -- the ledger ----------------------------------------------------------------------------------
    def add(self, handles: Any, *, via: Any) -> None:
        """Own ``handles`` (handles or ids), to be released through ``via``, their creator. A handle
        owned already keeps its first creator; a closed scope takes nothing."""
        ids = handle_ids(handles)
        with self._lock:
            if self.closed:
                return
            for handle_id in ids:
                self._owned.setdefault(handle_id, via)

    def owned(self) -> list[str]:
        """The ids this scope would release now (oldest first), kept ones excluded."""
        with self._lock:
            ids = list(self._owned)
        return [i for i in ids if not is_kept(i)]

    def keep(self, *handles: Any) -> None:
        """This scope will not release ``handles`` (an enclosing scope still may)."""
        self.forget(handle_ids(list(handles)))

    def forget(self, handles: Any) -> None:
        """Stop owning ``handles`` (released elsewhere, or handed over)."""
        ids = set(handle_ids(handles if isinstance(handles, list) else [handles]))
        with self._lock:
            for handle_id in ids:
                self._owned.pop(handle_id, None)

    def take(self, handles: Any) -> list[tuple[str, Any]]:
        """Hand over ``handles``: stop owning them and return ``(id, creator)`` of those owned."""
        ids = handle_ids(handles if isinstance(handles, list) else [handles])
        with self._lock:
            return [(i, self._owned.pop(i)) for i in ids if i in self._owned]

    def adopt(self, entries: Iterable[tuple[str, Any]]) -> None:
        """Own the ``(id, creator)`` entries another scope handed over (:meth:`take`)."""
        with self._lock:
            for handle_id, via in entries:
                self._owned.setdefault(handle_id, via)

    def _drain(self, keep: Iterable[str]) -> dict[int, tuple[Any, list[str]]]:
        """Remove what will be released now (all but ``keep`` and kept ids), grouped by creator."""
        keep = set(keep)
        groups: dict[int, tuple[Any, list[str]]] = {}
        with self._lock:
            for handle_id, via in list(self._owned.items()):
                if handle_id in keep or is_kept(handle_id):
                    continue
                del self._owned[handle_id]
                groups.setdefault(id(via), (via, []))[1].append(handle_id)
        return groups

    def _log(self, counts: list[tuple[int, int]], left: int) -> int:
        done = sum(c[0] for c in counts)
        gone = sum(c[1] for c in counts)
        if done or gone:
            log.debug("kvbaton %s: released %d handles (%d already gone), %d still owned", self.name, done, gone, left)
        return done

    def release(self, *, keep: Iterable[str] = ()) -> int:
        """Release every owned handle but ``keep`` (ids) and kept ones; returns how many were freed.
        Handles of an async-only client cannot be released from here: they stay owned (logged)."""
        counts, stuck = [], []
        for via, ids in self._drain(keep).values():
            if is_async(via):  # an asynchronous client without a blocking one (the client records through that)
                stuck.append((via, ids))
                continue
            counts.append(release_quietly(via, ids))
        for via, ids in stuck:
            log.warning("kvbaton %s: %d handles of an async client left for aclose()", self.name, len(ids))
            self.adopt((i, via) for i in ids)
        return self._log(counts, len(self))

    async def arelease(self, *, keep: Iterable[str] = ()) -> int:
        """:meth:`release`, awaited: async clients are awaited, sync ones run in a worker thread."""
        counts = [await arelease_quietly(via, ids) for via, ids in self._drain(keep).values()]
        return self._log(counts, len(self))

    def close(self) -> int:
        """Release what is owned and take nothing more."""
        with self._lock:
            self.closed = True
        return self.release()

    async def aclose(self) -> int:
        with self._lock:
            self.closed = True
        return await self.arelease()

    # -- activation ----------------------------------------------------------------------------------
    def activate(self) -> Token[tuple[Scope, ...]]:
        """Make this scope record the handles created in the current context from now on."""
        return _ACTIVE.set((*_ACTIVE.get(), self))

    @staticmethod
    def deactivate(token: Token[tuple[Scope, ...]]) -> None:
        try:
            _ACTIVE.reset(token)
        except ValueError:  # reset from another context (an async generator closed elsewhere)
            pass

    def __enter__(self) -> Self:
        self._tokens.append(self.activate())
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.deactivate(self._tokens.pop())
        try:
            self.close()
        except Exception:
            if exc is None:
                raise
            log.warning("kvbaton %s: releasing its handles failed", self.name, exc_info=True)

    async def __aenter__(self) -> Self:
        self._tokens.append(self.activate())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.deactivate(self._tokens.pop())
        try:
            await self.aclose()
        except Exception:
            if exc is None:
                raise
            log.warning("kvbaton %s: releasing its handles failed", self.name, exc_info=True)


__all__ = [
    "GONE",
    "Scope",
    "active",
    "arecord_stream",
    "arelease_quietly",
    "check_session",
    "current_session",
    "handle_ids",
    "is_kept",
    "keep",
    "record",
    "record_stream",
    "release_quietly",
    "released",
]
