"""Adapter ownership: a run of a wrapped app is a scope; what its result references outlives it.

Shared by the framework adapters (the LangGraph wrapper per ``thread_id``, the AutoGen adapter's
model clients), over :mod:`kvbaton.scope` only:

- :func:`run_scope` — the scope of one run; it records the handles of every kvbaton client;
- :func:`referenced_ids` — the handle ids a result (a state, a checkpoint, messages) references;
- :func:`end_run` / :func:`aend_run` — the run's referenced handles go to a longer-lived owner (a
  thread), which releases what it held that the new result no longer references; the rest is
  released;
- :class:`Threads` — one owner per thread id, with ``retained``/``release``;
- :func:`release_oldest` — an owner keeps at most ``limit`` handles, the oldest released first.

Retained handles are a cache, not a reservation: an owner holds at most
:data:`MAX_RETAINED_HANDLES` by default (the adapters' ``max_retained_handles`` knob), and the engine
spills whatever an idle retained handle holds when a request needs the room (docs/cache.md). A
released handle that a later prompt still names only costs a prefill (the adapters fall back to
plain prefill on a stale handle).

Invariants: cleanup never raises into the app (failures are logged); a handle the user kept
(``client.keep``) is never released here; gone handles are skipped (the scope's rule).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from typing import Any

from kvbaton.handle import Handle
from kvbaton.scope import Scope

log = logging.getLogger("kvbaton.adapters")

_HANDLE_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_RETAINED_HANDLES = 16
"""Handles an adapter retains per LangGraph thread or per AutoGen agent by default: enough for every agent's
latest turns of a workflow (what their next prompts reuse), few enough that a thread or a long run holds a
bounded share of the pool. None: no bound."""
_WALK_LIMIT = 100_000  # objects visited per state: a pathological state costs bounded time


def referenced_ids(obj: Any) -> set[str]:
    """The handle ids a run's result references: :class:`~kvbaton.Handle` objects, handle dicts
    (``{"id": ..., "lineage": ...}``, e.g. on a LangChain message's ``additional_kwargs``) and
    handle-id strings, anywhere in dicts, sequences, pydantic models and dataclasses."""
    found: set[str] = set()
    todo, seen = [obj], set()
    while todo and len(seen) < _WALK_LIMIT:
        item = todo.pop()
        if isinstance(item, str):
            if len(item) == 32 and _HANDLE_ID.match(item):
                found.add(item)
            continue
        if item is None or isinstance(item, int | float | bytes) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Handle):
            found.add(item.id)
        elif isinstance(item, Mapping):
            if isinstance(item.get("id"), str) and ("lineage" in item or "model_fingerprint" in item):
                # a handle's JSON (full, or a compact reference): its tokens and fingerprints are no ids
                todo.append(item["id"])
            else:
                todo.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            todo.extend(item)
        elif hasattr(item, "__dict__") and not callable(item):
            todo.extend(vars(item).values())
    return found


def run_scope(name: str) -> Scope:
    """The scope of one run of a wrapped app: it records the handles of every kvbaton client."""
    return Scope(name=name)


def _handover(run: Scope, owner: Scope, refs: set[str]) -> None:
    order = {handle_id: n for n, handle_id in enumerate(run.owned())}  # creation order: the oldest go first
    owner.adopt(run.take(sorted(refs, key=lambda h: (order.get(h, len(order)), h))))


def check_limit(limit: int | None) -> int | None:
    """``limit`` as a bound on retained handles (None: no bound); ValueError unless a positive int."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"max_retained_handles must be a positive integer or None, got {limit!r}")
    return limit


def _over(owner: Scope, limit: int | None) -> list[str]:
    """All but the latest ``limit`` of what ``owner`` holds (to keep); [] when within the bound."""
    held = owner.owned()
    return held[-limit:] if limit is not None and len(held) > limit else []


def release_oldest(owner: Scope, limit: int | None) -> int:
    """``owner`` keeps its latest ``limit`` handles and releases the older ones; how many. Never raises."""
    keep = _over(owner, limit)
    if not keep:
        return 0
    try:
        return owner.release(keep=keep)
    except Exception as exc:  # noqa: BLE001
        log.warning("kvbaton: releasing the handles of %s failed: %s", owner.name, exc)
        return 0


async def arelease_oldest(owner: Scope, limit: int | None) -> int:
    keep = _over(owner, limit)
    if not keep:
        return 0
    try:
        return await owner.arelease(keep=keep)
    except Exception as exc:  # noqa: BLE001
        log.warning("kvbaton: releasing the handles of %s failed: %s", owner.name, exc)
        return 0


def release_superseded(owner: Scope, refs: set[str]) -> None:
    """``owner`` releases what it holds that ``refs`` (its new result) no longer names. Never raises."""
    try:
        owner.release(keep=refs)
    except Exception as exc:  # noqa: BLE001
        log.warning("kvbaton: releasing the handles of %s failed: %s", owner.name, exc)


def end_run(run: Scope, owner: Scope | None, refs: set[str], *, supersede: bool = True,
            limit: int | None = None) -> None:
    """End ``run``: the handles it made that ``refs`` names go to ``owner`` (which, with
    ``supersede``, releases what it held that ``refs`` no longer names, and keeps at most ``limit``,
    the oldest released first); the rest is released. Never raises: a failed release is logged."""
    try:
        if owner is not None:
            _handover(run, owner, refs)
            if supersede:
                owner.release(keep=refs)
            release_oldest(owner, limit)
        run.close()
    except Exception as exc:  # noqa: BLE001 - cleanup must not break the app's result
        log.warning("kvbaton: releasing the handles of %s failed: %s", run.name, exc)


async def aend_run(run: Scope, owner: Scope | None, refs: set[str], *, supersede: bool = True,
                   limit: int | None = None) -> None:
    try:
        if owner is not None:
            _handover(run, owner, refs)
            if supersede:
                await owner.arelease(keep=refs)
            await arelease_oldest(owner, limit)
        await run.aclose()
    except Exception as exc:  # noqa: BLE001
        log.warning("kvbaton: releasing the handles of %s failed: %s", run.name, exc)


class Threads:
    """Per thread id (None: runs without one), the owner of what its latest result references."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._owners: dict[Any, Scope] = {}
        self._lock = threading.Lock()

    def owner(self, thread: Any) -> Scope:
        with self._lock:
            owner = self._owners.get(thread)
            if owner is None:
                owner = self._owners[thread] = Scope(name=f"{self.kind} thread {thread!r}")
            return owner

    def retained(self, thread: Any = None) -> list[str]:
        with self._lock:
            owner = self._owners.get(thread)
        return owner.owned() if owner is not None else []

    def _pop(self, thread: Any) -> Scope | None:
        with self._lock:
            return self._owners.pop(thread, None)

    def release(self, thread: Any = None) -> int:
        owner = self._pop(thread)
        return owner.close() if owner is not None else 0

    async def arelease(self, thread: Any = None) -> int:
        owner = self._pop(thread)
        return await owner.aclose() if owner is not None else 0


__all__ = [
    "MAX_RETAINED_HANDLES",
    "Threads",
    "aend_run",
    "arelease_oldest",
    "check_limit",
    "end_run",
    "referenced_ids",
    "release_oldest",
    "release_superseded",
    "run_scope",
]
