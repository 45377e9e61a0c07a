"""Tenancy: who is asking, which handles are theirs, and the handle each of their agents retains.

Each bearer token is a tenant (``tenant_map``); without tokens everything is one tenant. Invariants:
a tenant sees only the handles it made (``Owners``: any other id is ``HandleNotFound``, exactly as an
unknown one); tenants share the engine but not agent names (``AgentNames``: tenant ``t``'s agent
``a`` is ``t/a`` in the engine); an OpenAI agent retains one handle, its latest (``AgentSlots``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from kvbaton.errors import HandleNotFound, InvalidRequest

from ..protocol import MAX_AGENT_CHARS

SINGLE_TENANT = "default"
_RELEASED_OWNERS = 1_000_000  # released ids remembered, so that owners still get HandleReleased

SlotKey = tuple[str, str]  # (tenant, agent)


def tenant_id(token: str) -> str:
    """The tenant a bearer token stands for (a hash: tokens never appear in logs or metrics)."""
    return "t-" + hashlib.sha256(token.encode()).hexdigest()[:16]


def tenant_map(token: str | Sequence[str] | Mapping[str, str] | None) -> dict[str, str]:
    """``{token: tenant}`` of one token, several, or a given map; empty: no authentication."""
    if not token:
        return {}
    if isinstance(token, str):
        tokens: dict[str, str] = {token: tenant_id(token)}
    elif isinstance(token, Mapping):
        tokens = {str(k): str(v) for k, v in token.items()}
    else:
        tokens = {t: tenant_id(t) for t in token}
    if any(not t or t != t.strip() or any(c.isspace() for c in t) for t in tokens):
        raise InvalidRequest("tokens must be non-empty and contain no whitespace")
    return tokens


def request_tenant(request: Request) -> str:
    """The tenant the auth middleware found for this request."""
    return request.scope.get("kvbaton.tenant", SINGLE_TENANT)


def request_agent(request: Request, given: str | None) -> str | None:
    """The request's agent tag: the body's own, else the ``X-Kvbaton-Agent`` header."""
    return given if given is not None else request.headers.get("x-kvbaton-agent") or None


@dataclass(frozen=True)
class AgentNames:
    """Engine names of tenants' agents: ``tenant/agent`` on a multi-tenant server, else the name itself."""

    multi_tenant: bool

    def engine_name(self, tenant: str, agent: str | None) -> str | None:
        if not agent:
            return None
        if len(agent) > MAX_AGENT_CHARS:
            raise InvalidRequest(f"agent names are at most {MAX_AGENT_CHARS} characters")
        return f"{tenant}/{agent}" if self.multi_tenant else agent

    def own_name(self, tenant: str, engine_name: str) -> str | None:
        """The tenant's own name of an engine agent name, or None for another tenant's agent."""
        if not self.multi_tenant:
            return engine_name
        prefix = f"{tenant}/"
        return engine_name[len(prefix):] if engine_name.startswith(prefix) else None


class Owners:
    """Which tenant made each handle id. A tenant asking about any other id gets ``HandleNotFound``,
    exactly as for an id that never existed; released ids are remembered (bounded) so that their
    owner still gets ``HandleReleased`` from the engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, str] = {}
        self._released: OrderedDict[str, str] = OrderedDict()

    def add(self, tenant: str, handle_ids: Iterable[str]) -> None:
        with self._lock:
            for hid in handle_ids:
                self._live[hid] = tenant

    def check(self, tenant: str, handle_ids: Iterable[str]) -> None:
        with self._lock:
            for hid in handle_ids:
                owner = self._live.get(hid) or self._released.get(hid)
                if owner != tenant:
                    raise HandleNotFound(f"no handle {hid} in this engine")

    def released(self, handle_ids: Iterable[str]) -> None:
        with self._lock:
            for hid in handle_ids:
                owner = self._live.pop(hid, None)
                if owner is not None:
                    self._released[hid] = owner
                    if len(self._released) > _RELEASED_OWNERS:
                        self._released.popitem(last=False)

    def live(self, tenant: str) -> list[str]:
        with self._lock:
            return [hid for hid, owner in self._live.items() if owner == tenant]


@dataclass
class Slot:
    """One agent's retained handle; ``lock`` is held while a request reuses or replaces it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    handle_id: str | None = None

    def replace(self, handle_id: str | None) -> str | None:
        """Hold ``handle_id`` instead; the handle held before (the caller releases it)."""
        with self.lock:
            old, self.handle_id = self.handle_id, handle_id
        return old

    def take(self) -> str | None:
        """Empty the slot; the handle it held (the caller releases it)."""
        return self.replace(None)


class AgentSlots:
    """The latest result handle of each (tenant, agent) of the OpenAI endpoints.

    An agent's next request reuses it (the engine keeps the longest common token prefix), then the
    new result replaces it and the old one is released: a chatting agent holds one handle, not one
    per turn. Least recently used slots are dropped beyond ``max_slots`` or when the pool is full.
    """

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self._lock = threading.Lock()
        self._slots: OrderedDict[SlotKey, Slot] = OrderedDict()

    def slot(self, key: SlotKey) -> Slot:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = Slot()
            self._slots.move_to_end(key)
            return slot

    def oldest_idle(self, exclude: SlotKey | None = None) -> Slot | None:
        """The least recently used slot holding a handle that no request is using now."""
        with self._lock:
            for key, slot in self._slots.items():
                if key != exclude and slot.handle_id is not None and not slot.lock.locked():
                    return slot
            return None

    def overflow(self) -> list[Slot]:
        """Drop least recently used idle slots beyond ``max_slots``; the dropped ones."""
        with self._lock:
            out = []
            for key in list(self._slots):
                if len(self._slots) <= self.max_slots:
                    break
                slot = self._slots[key]
                if not slot.lock.locked():
                    out.append(self._slots.pop(key))
            return out

    def forget(self, handle_ids: set[str]) -> None:
        with self._lock:
            for slot in self._slots.values():
                if slot.handle_id in handle_ids:
                    slot.handle_id = None

    def tenant_slots(self, tenant: str) -> list[Slot]:
        with self._lock:
            return [slot for (t, _), slot in self._slots.items() if t == tenant]
