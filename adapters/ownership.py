"""Adapter ownership: a run of a wrapped app is a scope; what its result references outlives it.

Shared by the framework adapters (the LangGraph wrapper per ``thread_id``, the AutoGen adapter's
model clients), over :mod:`kvbaton.scope` only:

- :func:`run_scope` — the scope of one run; it records the handles of every kvbaton client;
- :func:`referenced_ids` — the handle ids a result (a state, a checkpoint, messages) references;
- :func:`end_run` / :func:`aend_run` — the run's referenced handles go to a longer-lived owner (a
  thread), which releases what it held that the new result no longer references; the rest is
  released;
- :class:`Threads` — one owner per thread id, with ``retained``/``release``.

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
    owner.adopt(run.take(sorted(refs)))


def release_superseded(owner: Scope, refs: set[str]) -> None:
    """``owner`` releases what it holds that ``refs`` (its new result) no longer names. Never raises."""
    try:
        owner.release(keep=refs)
    except Exception as exc:  # noqa: BLE001
        log.warning("kvbaton: releasing the handles of %s failed: %s", owner.name, exc)


def end_run(run: Scope, owner: Scope | None, refs: set[str], *, supersede: bool = True) -> None:
    """End ``run``: the handles it made that ``refs`` names go to ``owner`` (which, with
    ``supersede``, releases what it held that ``refs`` no longer names); the rest is released.
    Never raises: a failed release is logged."""
    try:
        if owner is not None:
            _handover(run, owner, refs)
            if supersede:
                owner.release(keep=refs)
        run.close()
    except Exception as exc:  # noqa: BLE001 - cleanup must not break the app's result
        log.warning("kvbaton: releasing the handles of %s failed: %s", run.name, exc)


async def aend_run(run: Scope, owner: Scope | None, refs: set[str], *, supersede: bool = True) -> None:
    try:
        if owner is not None:
            _handover(run, owner, refs)
            if supersede:
                await owner.arelease(keep=refs)
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


__all__ = ["Threads", "aend_run", "end_run", "referenced_ids", "release_superseded", "run_scope"]
