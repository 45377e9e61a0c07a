"""Tenants: whose a request is (:class:`AgentRef`) and which shared structures each tenant keeps to
itself (:class:`TenantPartition`).

A leaf: it imports nothing of the backend, so the cache, the engine, the cluster and the server all
read tenants the same way. A tenant travels as a typed field, never inside an agent string; the one
place a label is read back is :meth:`AgentRef.parse`, beside the label format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvbaton.errors import InvalidRequest
from kvbaton.ops import MAX_AGENT_CHARS, check_agent
from kvbaton.scope import current_session

MAX_TENANT_CHARS = 64  # a server's tenant ids are 18 characters ("t-" and 16 hex digits)
# How long an agent's label (``tenant/name``) may be: an engine's internal layers check this, the
# operators check the name a caller gave against MAX_AGENT_CHARS, the same limit on every backend.
MAX_LABEL_CHARS = MAX_TENANT_CHARS + 1 + MAX_AGENT_CHARS


@dataclass(frozen=True)
class AgentRef:
    """Whose a request is: the ``tenant`` of a multi-tenant server (None: no tenant — an embedded
    engine, a single-tenant server, engine-internal work), the tenant's own agent ``name`` (None: an
    agentless request) and the ``session`` it belongs to (a workflow run: a server session, a LangGraph
    thread; None: not known), which partitions approximate reuse (``EngineConfig.span_partition``)."""

    tenant: str | None = None
    name: str | None = None
    session: str | None = None

    def __post_init__(self) -> None:
        if self.tenant is not None and (
            not isinstance(self.tenant, str) or not self.tenant or "/" in self.tenant
            or len(self.tenant) > MAX_TENANT_CHARS
        ):
            raise InvalidRequest(
                f"a tenant is a non-empty string of at most {MAX_TENANT_CHARS} characters without '/', "
                f"got {self.tenant!r}"
            )
        if self.session is not None and (
            not isinstance(self.session, str) or not self.session or len(self.session) > MAX_AGENT_CHARS
        ):
            raise InvalidRequest(
                f"a session is a non-empty string of at most {MAX_AGENT_CHARS} characters, got {self.session!r}"
            )

    @property
    def label(self) -> str | None:
        """How engines show the agent: ``tenant/name`` (``tenant/`` when agentless), else the name."""
        if self.tenant is None:
            return self.name
        return f"{self.tenant}/{self.name or ''}"

    @classmethod
    def of(cls, agent: str | AgentRef | None) -> AgentRef:
        """An operator's ``agent`` argument as an ``AgentRef`` (``AgentRef()`` for None): a plain name
        has no tenant, whatever it spells, and belongs to the reuse session of the caller's scope
        (:func:`kvbaton.scope.current_session`: an adapter's run), as an HTTP client's request carries it in
        ``X-Kvbaton-Session``. Not checked here: a request's agent is checked where the request fails as a
        request (:func:`check_agent_of`), so that its error is an event too."""
        return agent if isinstance(agent, AgentRef) else cls(None, agent, current_session())

    @classmethod
    def parse(cls, label: str | None) -> AgentRef:
        """The inverse of :attr:`label` for labels made under a tenant (tenant names hold no ``/``):
        ``t/a`` is tenant ``t``'s agent ``a``, ``t/`` its agentless request; a label without ``/``
        has no tenant. Never raises: it reads back what an engine showed."""
        tenant, sep, name = (label or "").partition("/")
        return cls(tenant, name or None) if sep and tenant else cls(None, label or None)


Agent = str | AgentRef  # what an engine's operators take as ``agent``


def check_label(label: str | None) -> None:
    """An agent as an engine's internal layers see it (its label, made from a checked ``AgentRef``)."""
    if label is not None and (not isinstance(label, str) or not label or len(label) > MAX_LABEL_CHARS):
        raise InvalidRequest(f"agent must be a non-empty string of at most {MAX_AGENT_CHARS} characters")


def check_agent_of(agent: Agent | None) -> None:
    """``InvalidRequest`` unless ``agent`` names an agent as every backend accepts it: an operator's
    ``AgentRef`` (the engine makes one of every ``agent`` argument) has a name of at most
    ``MAX_AGENT_CHARS`` characters, under any tenant; a string is a label an engine made itself."""
    if isinstance(agent, AgentRef):
        check_agent(agent.name)
    else:
        check_label(agent)


def label_of(agent: Agent | None) -> str | None:
    """How an engine shows ``agent``: an ``AgentRef``'s label, a plain name itself."""
    return agent.label if isinstance(agent, AgentRef) else agent


@dataclass(frozen=True)
class TenantPartition:
    """Which of an engine's shared structures each tenant keeps to itself. ``prefix_cache``: a request
    reuses, waits on and loads back only prefix-cache blocks its own tenant's requests computed (so a
    tenant cannot tell from its reuse or time to first token what another sent). ``spans``:
    cross-prefix reuse places only spans of its own tenant's live handles. False (the default): one
    partition that every request shares. A request without a tenant neither reads nor feeds a
    partitioned structure."""

    prefix_cache: bool = False
    spans: bool = False

    def cache_partition(self, tenant: str | None) -> str | None:
        """The prefix-cache partition of a request of ``tenant`` (None: no prefix cache)."""
        return _partition_of_tenant(self.prefix_cache, tenant)

    def span_partition(self, tenant: str | None, session: str | None = None) -> str | None:
        """The span partition of a request of ``tenant`` (None: no cross-prefix reuse); with a ``session``,
        that session's own partition inside it."""
        partition = _partition_of_tenant(self.spans, tenant)
        return partition if partition is None or session is None else f"{partition}\x1f{session}"

    def within(self, possible: TenantPartition) -> bool:
        """Whether an engine that can keep ``possible`` apart can keep this apart."""
        return (possible.prefix_cache or not self.prefix_cache) and (possible.spans or not self.spans)


def _partition_of_tenant(per_tenant: bool, tenant: str | None) -> str | None:
    return tenant if per_tenant else ""


SHARED = TenantPartition()


class Owned(Protocol):
    """What a partition is read off: a request's ``AgentRef`` or the state it made."""

    tenant: str | None
    session: str | None


class Partitions:
    """The partitions of an engine's requests as its current :class:`TenantPartition` says (``current``; set when a
    server asks), spans by session where ``by_session``. The KV manager and the span index hold its methods: an
    object of its own, not the engine, so that what they keep alive never includes the engine."""

    def __init__(self, by_session: bool) -> None:
        self.current = SHARED
        self._by_session = by_session

    def cache(self, owner: Owned) -> str | None:
        """The prefix-cache partition: the owner's tenant's, or the one shared partition (None: none)."""
        return self.current.cache_partition(owner.tenant)

    def spans(self, owner: Owned) -> str | None:
        """The span partition (None: no cross-prefix reuse): the tenant's, or within it the owner's session."""
        return self.current.span_partition(owner.tenant, owner.session if self._by_session else None)
