"""Tenancy: who is asking, which handles are theirs, what they may hold, and the handle each of
their agents retains.

Each bearer token is a tenant (``tenant_map``); without tokens everything is one tenant. Invariants:
a tenant sees only the handles it made (``Owners``: any other id is ``HandleNotFound``, exactly as an
unknown one); tenants share the engine but not agent names (``AgentNames``: each request carries its
tenant to the engine in an :class:`..tenants.AgentRef`, and the engine shows tenant ``t``'s agent ``a``
as ``t/a``, its agentless requests as ``t/``), nor the spans that cross-prefix reuse places, nor the
prefix cache (the engine's tenant partition, unless the server shares them explicitly); a tenant's
live handles, plus those its requests in flight may make, stay within its ``Quota``
(``Owners.admit``); an OpenAI agent retains one handle per session, its latest (``AgentSlots``,
keyed by tenant, session and agent: two sessions of one app never resume each other's turns), and
only its own tenant's requests may evict it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from kvbaton.errors import HandleNotFound, InvalidRequest, QuotaExceeded
from kvbaton.ops import check_reuse
from kvbaton.serverconf import HOST_BYTES_PER_HANDLE_TOKEN, check_tokens
from kvbaton.types import Reuse

from ..tenants import AgentRef
from .protocol import MAX_AGENT_CHARS

SINGLE_TENANT = "default"
_RELEASED_OWNERS = 1_000_000  # released ids remembered, so that owners still get HandleReleased
# Per-process secret of tenant ids: an id (in stats, logs) cannot be tested against guessed tokens offline.
_SALT = secrets.token_bytes(32)

SlotKey = tuple[str, str, str]  # (tenant, session, agent); "" is the default session and no agent
SESSION_HEADER = "x-kvbaton-session"


def tenant_id(token: str, salt: bytes | None = None) -> str:
    """The tenant a bearer token stands for: a keyed hash (HMAC-SHA256 with a per-process random
    ``salt``), so tokens never appear in logs or metrics and an id reveals nothing about its token."""
    digest = hmac.new(_SALT if salt is None else salt, token.encode(), hashlib.sha256).hexdigest()
    return "t-" + digest[:16]


def tenant_map(token: str | Sequence[str] | Mapping[str, str] | None, salt: bytes | None = None) -> dict[str, str]:
    """``{token: tenant}`` of one token, several, or a given map; empty: no authentication. ``salt``:
    the secret of the tenant ids (a persistent server's own, so ids survive a restart; default per process)."""
    if not token:
        return {}
    if isinstance(token, str):
        tokens: dict[str, str] = {token: tenant_id(token, salt)}
    elif isinstance(token, Mapping):
        tokens = {str(k): str(v) for k, v in token.items()}
    else:
        tokens = {t: tenant_id(t, salt) for t in token}
    check_tokens(list(tokens))
    if any(not name or "/" in name for name in tokens.values()):
        raise InvalidRequest("tenant names must be non-empty and contain no '/' (it separates tenant and agent)")
    return tokens


def request_tenant(request: Request) -> str:
    """The tenant the auth middleware found for this request."""
    return request.scope.get("kvbaton.tenant", SINGLE_TENANT)


def request_agent(request: Request, given: str | None) -> str | None:
    """The request's agent tag: the body's own, else the ``X-Kvbaton-Agent`` header."""
    return given if given is not None else request.headers.get("x-kvbaton-agent") or None


def request_session(request: Request, given: str | None, user: Any = None) -> str:
    """The request's session: the ``X-Kvbaton-Session`` header, else the body's ``kvbaton.session``,
    else OpenAI's ``user`` field, else the default session ``""``."""
    session = request.headers.get(SESSION_HEADER) or given or (user if isinstance(user, str) else None) or ""
    if len(session) > MAX_AGENT_CHARS:
        raise InvalidRequest(f"session names are at most {MAX_AGENT_CHARS} characters", param="session")
    return session


def request_reuse(request: Request, given: Reuse | None) -> Reuse | None:
    """The request's reuse policy: the body's own, else the ``X-Kvbaton-Reuse`` header (None: neither)."""
    if given is not None:
        return given
    header = request.headers.get("x-kvbaton-reuse") or None
    check_reuse(header)
    return header  # type: ignore[return-value]


@dataclass(frozen=True)
class AgentNames:
    """Tenants' agents for the engine: on a multi-tenant server every request carries its tenant (an
    agentless one too, so that the engine can partition its prefix cache and spans by it); without
    tokens, the agent alone (None: no agent)."""

    multi_tenant: bool

    def agent(self, tenant: str, agent: str | None, session: str | None = None) -> AgentRef | None:
        """``session`` (a workflow run, None: not known) bounds the request's approximate reuse in the engine."""
        if agent and len(agent) > MAX_AGENT_CHARS:
            raise InvalidRequest(f"agent names are at most {MAX_AGENT_CHARS} characters")
        if not self.multi_tenant:
            return AgentRef(None, agent or None, session or None) if agent or session else None
        return AgentRef(tenant, agent or None, session or None)

    def own_name(self, tenant: str, label: str) -> str | None:
        """The tenant's own name of an agent as the engine shows it ("" for its agentless requests), or
        None for another tenant's agent."""
        if not self.multi_tenant:
            return label
        ref = AgentRef.parse(label)
        return (ref.name or "") if ref.tenant == tenant else None


@dataclass(frozen=True)
class Quota:
    """What one tenant may hold: live handles; KV bytes approximated as the tokens of its live
    handles times ``bytes_per_token``; and the tokens of its live handles themselves, which bound
    the host memory of their token lists (every handle, forks included, keeps its own list of
    token ids on the host). Forks sharing blocks count in full: a bound on what the tenant could
    come to hold. None: no limit.

    Why a token quota rather than forks sharing their parent's token list (copy-on-write): the quota
    bounds every handle's list, forks or not, at admission, without touching the engine's token
    lists, which generation appends to in place."""

    max_handles: int | None = None
    max_kv_bytes: int | None = None
    bytes_per_token: float = 0.0
    max_handle_tokens: int | None = None


@dataclass
class _Owned:
    tenant: str
    tokens: int
    used: float  # clock time of the last operation naming the handle
    adopted: bool = False  # another server of the cluster made it: that server's TTL releases it


@dataclass
class _Holding:
    """One tenant's live handles and what its requests in flight may still add."""

    handles: int = 0
    tokens: int = 0
    pending_handles: int = 0
    pending_tokens: int = 0


class Admission:
    """What an admitted request may make, counted against its tenant until ``close`` (idempotent)."""

    def __init__(self, owners: Owners, tenant: str, handles: int, tokens: int) -> None:
        self._owners, self.tenant, self.handles, self.tokens = owners, tenant, handles, tokens
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self._owners.settle(self)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Owners:
    """Which tenant made each handle id, how many tokens it holds and when it was last used.

    A tenant asking about any other id gets ``HandleNotFound``, exactly as for an id that never
    existed; released ids are remembered (bounded) so that their owner still gets ``HandleReleased``
    from the engine. ``admit`` holds each tenant to the ``Quota``. ``lookup`` (a cluster several
    servers serve) says who made a handle this server did not: (tenant, tokens), None if not live."""

    def __init__(self, quota: Quota | None = None, clock: Callable[[], float] = time.monotonic,
                 lookup: Callable[[str], tuple[str | None, int] | None] | None = None) -> None:
        self.quota = quota or Quota()
        self._clock = clock
        self._lookup = lookup
        self._lock = threading.Lock()
        self._live: dict[str, _Owned] = {}
        self._held: dict[str, _Holding] = {}
        self._released: OrderedDict[str, str] = OrderedDict()

    def add(self, tenant: str, handles: Iterable[tuple[str, int]], *, adopted: bool = False) -> None:
        """Record ``(id, tokens)`` of handles the tenant made (an id already recorded is refreshed);
        ``adopted``: made through another server of the same cluster."""
        now = self._clock()
        with self._lock:
            for hid, tokens in handles:
                old = self._live.get(hid)
                if old is not None:
                    self._drop(old)
                self._live[hid] = _Owned(tenant, tokens, now, adopted)
                held = self._held.setdefault(tenant, _Holding())
                held.handles += 1
                held.tokens += tokens

    def use(self, tenant: str, handle_ids: Iterable[str], check: bool = False) -> None:
        """Note that an operation names these handles (their idle time restarts); with ``check``,
        ``HandleNotFound`` unless each is the tenant's."""
        handle_ids = list(handle_ids)
        if self._lookup is not None:
            self._adopt([hid for hid in handle_ids if self.owner(hid) is None])
        now = self._clock()
        with self._lock:
            for hid in handle_ids:
                owned = self._live.get(hid)
                owner = owned.tenant if owned is not None else self._released.get(hid)
                if check and owner != tenant:
                    raise HandleNotFound(f"no handle {hid} in this engine")
                if owned is not None and owned.tenant == tenant:
                    owned.used = now

    def _adopt(self, handle_ids: list[str]) -> None:
        """Handles this server did not make but the engine knows the tenant of (another server of the same
        cluster made them: ``lookup``) are that tenant's here too."""
        for hid in handle_ids:
            found = self._lookup(hid) if self._lookup is not None else None
            if found is not None and found[0] is not None:
                self.add(found[0], [(hid, found[1])], adopted=True)

    def check(self, tenant: str, handle_ids: Iterable[str]) -> None:
        self.use(tenant, handle_ids, check=True)

    def owner(self, handle_id: str) -> str | None:
        """The tenant that made a live or released handle (None: unknown)."""
        with self._lock:
            owned = self._live.get(handle_id)
            return owned.tenant if owned is not None else self._released.get(handle_id)

    def holding(self, tenant: str) -> tuple[int, int]:
        """The tenant's live handles and their tokens."""
        with self._lock:
            held = self._held.get(tenant) or _Holding()
            return held.handles, held.tokens

    def tokens(self, handle_id: str) -> int:
        with self._lock:
            owned = self._live.get(handle_id)
            return owned.tokens if owned is not None else 0

    def released(self, handle_ids: Iterable[str]) -> None:
        with self._lock:
            for hid in handle_ids:
                owned = self._live.pop(hid, None)
                if owned is not None:
                    self._drop(owned)
                    self._released[hid] = owned.tenant
                    if len(self._released) > _RELEASED_OWNERS:
                        self._released.popitem(last=False)

    def _drop(self, owned: _Owned) -> None:
        held = self._held[owned.tenant]
        held.handles -= 1
        held.tokens -= owned.tokens

    def live(self, tenant: str) -> list[str]:
        with self._lock:
            return [hid for hid, owned in self._live.items() if owned.tenant == tenant]

    def mine(self, tenant: str, handle_ids: Iterable[str]) -> set[str]:
        """Those of ``handle_ids`` the tenant made (live or released)."""
        with self._lock:
            return {hid for hid in handle_ids
                    if (o.tenant if (o := self._live.get(hid)) is not None else self._released.get(hid)) == tenant}

    def idle(self, ttl: float) -> list[str]:
        """Live handles this server made that no operation named for longer than ``ttl`` seconds (one
        another server made is that server's to release: this one may not see its uses)."""
        cutoff = self._clock() - ttl
        with self._lock:
            return [hid for hid, owned in self._live.items() if owned.used < cutoff and not owned.adopted]

    # -- quotas -------------------------------------------------------------------------------
    def admit(self, tenant: str, handles: int = 1, tokens: int = 0) -> Admission:
        """Admit a request that may make ``handles`` handles of ``tokens`` tokens in all, or raise
        ``QuotaExceeded``; what it may make counts against the tenant until the admission closes."""
        handles, tokens = max(handles, 0), max(tokens, 0)
        q = self.quota
        with self._lock:
            held = self._held.setdefault(tenant, _Holding())
            if q.max_handles is not None:
                total = held.handles + held.pending_handles + handles
                if total > q.max_handles:
                    raise QuotaExceeded(
                        f"this would take the tenant to {total} live handles, over its quota of {q.max_handles}: "
                        "release handles first"
                    )
            if q.max_kv_bytes is not None:
                held_bytes = (held.tokens + held.pending_tokens) * q.bytes_per_token
                if held_bytes + tokens * q.bytes_per_token > q.max_kv_bytes:
                    raise QuotaExceeded(
                        f"the tenant's handles hold about {int(held_bytes)} bytes of KV (tokens x bytes per token)"
                        f"{f' and this request would add {int(tokens * q.bytes_per_token)}' if tokens else ''}: "
                        f"over its KV quota of {q.max_kv_bytes} bytes; release handles first"
                    )
            if q.max_handle_tokens is not None:
                total = held.tokens + held.pending_tokens + tokens
                if total > q.max_handle_tokens:
                    raise QuotaExceeded(
                        f"this would take the tenant's live handles to {total} tokens (forks counted in full), "
                        f"over its handle-token quota of {q.max_handle_tokens} tokens (about "
                        f"{q.max_handle_tokens * HOST_BYTES_PER_HANDLE_TOKEN // 2**20} MiB of host memory): "
                        "release handles first"
                    )
            held.pending_handles += handles
            held.pending_tokens += tokens
        return Admission(self, tenant, handles, tokens)

    def settle(self, admission: Admission) -> None:
        with self._lock:
            held = self._held[admission.tenant]
            held.pending_handles -= admission.handles
            held.pending_tokens -= admission.tokens


@dataclass
class Slot:
    """One agent's retained handle; ``lock`` is held while a request reuses or replaces it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    handle_id: str | None = None
    exact: bool = True  # whether the held handle's K/V equal dense prefill's (False: reused approximately)

    def replace(self, handle_id: str | None, exact: bool = True) -> str | None:
        """Hold ``handle_id`` (``exact`` or not) instead; the handle held before (the caller releases it)."""
        with self.lock:
            old, self.handle_id, self.exact = self.handle_id, handle_id, exact
        return old

    def take(self) -> str | None:
        """Empty the slot; the handle it held (the caller releases it)."""
        return self.replace(None)


class AgentSlots:
    """The latest result handle of each (tenant, session, agent) of the OpenAI endpoints.

    An agent's next request reuses it (the engine keeps the longest common token prefix), then the
    new result replaces it and the old one is released: a chatting agent holds one handle, not one
    per turn. A tenant's least recently used slots are dropped beyond ``max_slots`` of that tenant,
    or when the pool is full for one of its requests: a tenant never evicts another's.
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

    def overflow(self, tenant: str) -> list[Slot]:
        """Drop the tenant's least recently used idle slots beyond ``max_slots``; the dropped ones."""
        with self._lock:
            keys = [key for key in self._slots if key[0] == tenant]
            out = []
            for key in keys:
                if len(keys) - len(out) <= self.max_slots:
                    break
                slot = self._slots[key]
                if not slot.lock.locked():
                    out.append(self._slots.pop(key))
            return out

    def forget(self, handle_ids: set[str]) -> None:
        """The handles are gone: their slots hold nothing, and are dropped unless a request uses them
        (an idle session's slots end with its handles)."""
        with self._lock:
            for key, slot in list(self._slots.items()):
                if slot.handle_id in handle_ids:
                    slot.handle_id, slot.exact = None, True
                    if not slot.lock.locked():
                        del self._slots[key]

    def session(self, tenant: str, session: str) -> list[Slot]:
        """Drop the tenant's slots of one session; the dropped ones (the caller releases their handles)."""
        with self._lock:
            keys = [key for key in self._slots if key[0] == tenant and key[1] == session]
            return [self._slots.pop(key) for key in keys]

    def tenant_slots(self, tenant: str) -> list[Slot]:
        with self._lock:
            return [slot for key, slot in self._slots.items() if key[0] == tenant]


class RegisteredAgents:
    """The agents each tenant registered (their fixed prompts, ``POST /v1/kv/agents``), at most
    ``max_per_tenant`` each (None: no limit).

    The engine keeps each registered agent's fixed prompt on the host (its token ids, up to the
    model's context each). Beyond its limit a tenant's least recently registered agent is dropped
    (``add`` returns it, the caller unregisters it from the engine): registration is a caching hint
    (an unregistered agent's requests run as before, without the priority its fixed prompt had in the
    cache), so the newest hints win, as in any cache; a tenant never drops another's. Registering a
    name again refreshes it."""

    def __init__(self, max_per_tenant: int | None) -> None:
        self.max_per_tenant = max_per_tenant
        self._lock = threading.Lock()
        self._agents: dict[str, OrderedDict[str, AgentRef]] = {}

    def add(self, tenant: str, agent: AgentRef) -> list[AgentRef]:
        """Record the tenant's ``agent`` (as the engine names it); the agents dropped to make room."""
        with self._lock:
            mine = self._agents.setdefault(tenant, OrderedDict())
            mine[agent.label or ""] = agent
            mine.move_to_end(agent.label or "")
            dropped = []
            while self.max_per_tenant is not None and len(mine) > self.max_per_tenant:
                dropped.append(mine.popitem(last=False)[1])
            return dropped

    def remove(self, tenant: str, agent: AgentRef) -> bool:
        """Forget the tenant's ``agent``; whether it had registered it."""
        with self._lock:
            return self._agents.get(tenant, OrderedDict()).pop(agent.label or "", None) is not None

    def count(self, tenant: str) -> int:
        with self._lock:
            return len(self._agents.get(tenant, ()))
