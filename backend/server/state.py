"""``ServerState``: everything the endpoints share — the engine, tenancy, limits, metrics, threads.

The engine is any :class:`kvbaton.ops.EngineOps` (``Engine``, ``Cluster``, ``SglangEngine``); the
state calls it directly. Invariants: engine calls block, so endpoints make them through ``run`` (a
bounded pool of worker threads), never on the event loop; every handle a request makes is recorded
for its tenant as soon as it exists (``record``), and every release goes through the state so that
owners and agent slots forget the id; a request is admitted within its tenant's quota (``admit``)
before the engine runs it; every operation naming a handle restarts its idle time (``check_owned``),
and ``sweep`` releases handles idle longer than the TTL; the engine gets every tenant's hints at
once, and a tenant's stats show only its own agents; on a multi-tenant server a request's
cross-prefix reuse places only its own tenant's spans (unless shared explicitly), and where the engine
cannot scope them every request runs ``"exact"``; a request reuses only its own tenant's prefix-cache
blocks (unless shared explicitly), and an engine that cannot keep them apart is refused. With a persistent engine (``Engine(persist=True)``),
``record``, ``retained`` and every release also go to its handle journal (:mod:`..persist`), durably
before the answer, and the journal's handles are their tenants' (and their slots') again at start.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from kvbaton.client import sampling_params
from kvbaton.errors import HandleNotFound, HandleReleased, InvalidRequest, ServerUnavailable
from kvbaton.handle import Handle
from kvbaton.ops import EngineOps, check_reuse, ste_map
from kvbaton.types import Event, Events, Reuse, SamplingParams, Stats

from .. import protocol as p
from ..block_pool import blocks_for_budget
from .metrics import Metrics
from ..persist import Journal
from .tenancy import SINGLE_TENANT, Admission, AgentNames, AgentSlots, Owners, Quota, SlotKey

T = TypeVar("T")
log = logging.getLogger(__name__)


def ref_id(ref: p.HandleRef) -> str:
    return ref.id if isinstance(ref, Handle) else ref


def _one_scope(agent: str | None) -> str:
    """Every request's spans in one scope: all tenants share them (``--shared-spans``)."""
    return ""


class ServerState:
    """Everything the endpoints share: the engine, tenancy, limits, metrics."""

    def __init__(
        self,
        engine: EngineOps,
        *,
        tenants: Mapping[str, str],
        max_tokens: int | None,
        default_max_tokens: int,
        max_n: int,
        max_agents: int,
        threads: int,
        fallback_max_tokens: int,
        max_handles_per_tenant: int | None = None,
        max_kv_bytes_per_tenant: int | str | None = None,
        max_handle_tokens_per_tenant: int | None = None,
        handle_ttl: float | None = None,
        reuse: Reuse | None = None,
        shared_spans: bool = False,
        shared_prefix_cache: bool = False,
        served_model_names: Sequence[str] | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.engine = engine
        self.tenants = tenants
        self.multi_tenant = bool(tenants)
        self.names = AgentNames(self.multi_tenant)
        check_reuse(reuse)
        self.default_reuse: Reuse = reuse or getattr(engine, "reuse", None) or "exact"
        self.cross_prefix = self._scope_spans(shared_spans)
        self._scope_prefix_cache(shared_prefix_cache)
        first = engine.stats()
        if served_model_names is not None and (not served_model_names or not all(served_model_names)):
            raise InvalidRequest("served model names must be non-empty")
        # The names the OpenAI routes report (the first in answers); the engine's own name by default.
        self.model_names: list[str] = list(served_model_names or [first.model])
        self.model = self.model_names[0]
        self.max_context: int | None = engine.max_context
        # max_tokens caps every request (default: the model's context); default_max_tokens applies to
        # requests that give none, on every route.
        self.max_tokens = max_tokens or self.max_context or fallback_max_tokens
        self.default_max_tokens = min(default_max_tokens, self.max_tokens)
        self.max_n = max_n
        self.threads = threads
        if handle_ttl is not None and handle_ttl <= 0:
            raise InvalidRequest(f"the handle TTL must be > 0 seconds, got {handle_ttl}")
        self.handle_ttl = handle_ttl
        self.owners = Owners(Quota(
            max_handles=max_handles_per_tenant or None,
            max_kv_bytes=(blocks_for_budget(max_kv_bytes_per_tenant, first.bytes_per_block) * first.bytes_per_block
                          if max_kv_bytes_per_tenant else None),
            bytes_per_token=first.bytes_per_block / first.block_size,
            max_handle_tokens=max_handle_tokens_per_tenant or None,
        ))
        self.slots = AgentSlots(max_agents)
        # A persistent engine's handles of an earlier run: their tenants own them again.
        self.journal = journal
        for entry in journal.live() if journal is not None else ():
            tenant = entry.owner or SINGLE_TENANT
            self.owners.add(tenant, [(entry.handle.id, entry.handle.num_tokens)])
            if entry.slot is not None:
                self.slots.slot((tenant, entry.session, entry.slot)).replace(entry.handle.id)
        self.metrics = Metrics(engine.stats, engine.events, self._tenant_and_agent)
        self._hints_lock = threading.Lock()
        self._hints: dict[str, dict[str, float]] = {}  # tenant -> {engine agent name: steps}
        self._limiter: anyio.CapacityLimiter | None = None

    def _scope_spans(self, shared: bool) -> bool:
        """Keep each tenant's spans to itself (``engine.span_scope``); whether cross-prefix reuse may
        run at all: not on a multi-tenant server whose engine cannot scope its spans (a ``Cluster``:
        each worker keeps its own index), unless spans are ``shared`` across tenants explicitly."""
        if not self.multi_tenant:
            return True  # one tenant: the engine's own scoping (by default one scope)
        if shared:
            if hasattr(self.engine, "span_scope"):
                self.engine.span_scope = _one_scope
            return True
        if not hasattr(self.engine, "span_scope"):
            if self.default_reuse != "exact":
                log.warning("cross-prefix reuse is off: this engine (%s) cannot keep tenants' spans apart; "
                            "--shared-spans allows it across tenants", type(self.engine).__name__)
            return False
        self.engine.span_scope = self.names.span_scope
        return True

    def _scope_prefix_cache(self, shared: bool) -> None:
        """With several tenants, keep each tenant's prefix-cache blocks to itself (a tenant must not
        learn from its reuse, or its time to first token, what another sent), unless ``shared``; an
        engine that cannot is refused rather than silently shared. Set either way: the engine may
        have served another app before."""
        isolate = len(set(self.tenants.values())) > 1 and not shared  # one token: one tenant, nothing to keep apart
        scope = getattr(self.engine, "isolate_prefix_cache", None)
        if scope is not None:
            scope(isolate)
        elif isolate:
            raise InvalidRequest(
                f"this engine ({type(self.engine).__name__}) cannot keep tenants' prefix caches apart: serve one "
                "token, or share the prefix cache across tenants explicitly (--shared-prefix-cache)"
            )

    def _tenant_and_agent(self, engine_name: str) -> tuple[str, str]:
        """The (tenant id, the tenant's own agent name) of an engine agent name ("": none), for metric
        labels; with several tokens, tenant "unknown" for a name without a tenant part (not a request's)."""
        if not self.multi_tenant:
            return SINGLE_TENANT, engine_name
        tenant = self.names.span_scope(engine_name)
        if tenant is None:
            return "unknown", engine_name
        return tenant, engine_name[len(tenant) + 1:]

    def reuse(self, requested: Reuse | None) -> Reuse:
        """The reuse policy a request runs with: its own, else the server's default; always ``"exact"``
        where cross-prefix reuse is off (see ``_scope_spans``)."""
        return (requested or self.default_reuse) if self.cross_prefix else "exact"

    # -- threads ------------------------------------------------------------------------------
    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._limiter is None:  # made on first use: it belongs to the running event loop
            self._limiter = anyio.CapacityLimiter(self.threads)
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self._limiter)

    # -- handles and tenancy --------------------------------------------------------------------
    def check_owned(self, tenant: str, refs: Iterable[p.HandleRef | None]) -> None:
        """``HandleNotFound`` unless every given handle is the tenant's (None: not given); the
        handles count as used now (their idle time restarts)."""
        self.owners.use(tenant, [ref_id(r) for r in refs if r is not None], check=self.multi_tenant)

    def record(self, tenant: str, handles: Iterable[Handle], durable: bool = True) -> None:
        """The tenant owns these handles; ``durable``: journaled too (persistence), before the client hears
        of them. Handles released right after (a dropped stream's) need not be."""
        handles = list(handles)
        self.owners.add(tenant, [(h.id, h.num_tokens) for h in handles])
        if durable and self.journal is not None:  # durable before the client hears of the handles
            try:
                self.journal.add(tenant, handles)
            except OSError as exc:  # a full disk: refuse, rather than hand out handles a restart would lose
                self.release_quietly([h.id for h in handles])
                raise ServerUnavailable(
                    f"the handle journal cannot be written ({exc.strerror or exc}): the request's handles were "
                    "released; retry later"
                ) from exc

    def retained(self, key: SlotKey, handle_id: str) -> None:
        """The agent's slot ``key`` now retains ``handle_id`` (journaled: the slot holds it again after a restart)."""
        if self.journal is not None:
            try:
                self.journal.retain(handle_id, agent=key[2], session=key[1])
            except OSError as exc:  # the handle itself is journaled: after a restart it is owned, just not retained
                log.error("could not journal the slot of handle %s: %s", handle_id, exc)

    def admit(self, tenant: str, handles: int = 1, tokens: int = 0) -> Admission:
        """Admit a request making up to ``handles`` handles (``tokens`` in all, when known) within the
        tenant's quotas, else ``QuotaExceeded``; close the admission once its handles are recorded."""
        return self.owners.admit(tenant, handles, tokens)

    def admit_fork(self, tenant: str, ref: p.HandleRef, k: int) -> Admission:
        """A fork's ``k`` children, each as many tokens as the parent."""
        return self.admit(tenant, k, k * self.owners.tokens(ref_id(ref)))

    def handle(self, ref: p.HandleRef) -> Handle:
        """The whole handle of a reference (an id is described by the engine)."""
        return ref if isinstance(ref, Handle) else self.engine.describe(ref)

    def release(self, tenant: str, refs: Sequence[p.HandleRef]) -> None:
        self.check_owned(tenant, refs)
        self.engine.release(list(refs))
        ids = {ref_id(r) for r in refs}
        if self.journal is not None:
            self.journal.release(ids)
        self.owners.released(ids)
        self.slots.forget(ids)

    def release_quietly(self, handle_ids: Iterable[str | None]) -> None:
        """Release handles the server itself holds; already gone ones (None: none) are fine."""
        for hid in handle_ids:
            if hid is None:
                continue
            try:
                self.engine.release(hid)
            except (HandleNotFound, HandleReleased):
                pass
            if self.journal is not None:
                self.journal.release([hid])
            self.owners.released([hid])

    def sweep(self) -> list[str]:
        """Release every handle idle for longer than the TTL (none without one); the ids released."""
        if self.handle_ttl is None:
            return []
        idle = self.owners.idle(self.handle_ttl)
        self.slots.forget(set(idle))
        self.release_quietly(idle)
        return idle

    def healthy(self) -> tuple[bool, str]:
        """Whether the engine can serve now, and why (not)."""
        return self.engine.healthy()

    def release_all(self, tenant: str) -> int:
        """Release every live handle of the tenant, those its agents' slots retain included."""
        for slot in self.slots.tenant_slots(tenant):
            slot.take()
        ids = self.owners.live(tenant)
        self.release_quietly(ids)
        return len(ids)

    def release_session(self, tenant: str, session: str) -> int:
        """Release the handles the tenant's agents retain in ``session``; how many were held."""
        ids = [hid for slot in self.slots.session(tenant, session) if (hid := slot.take()) is not None]
        self.release_quietly(ids)
        return len(ids)

    # -- agents -------------------------------------------------------------------------------
    def agent(self, tenant: str, agent: str | None) -> str | None:
        """The engine's name of a tenant's agent: tenants share the engine, not agent names."""
        return self.names.engine_name(tenant, agent)

    def stats(self, tenant: str) -> Stats:
        """The engine's stats with the tenant's own agents only, by their own names (per-agent stats
        and steps-to-execution, of every worker of a cluster too; placement decisions of its own
        handles only); pool counters are the engine's."""
        stats = self.engine.stats()
        return self._own_stats(tenant, stats) if self.multi_tenant else stats

    def _own_stats(self, tenant: str, stats: Stats) -> Stats:
        def own(named: Mapping[str, Any]) -> dict[str, Any]:  # its agents ("": its agentless requests, no agent)
            return {mine: v for name, v in named.items() if (mine := self.names.own_name(tenant, name))}

        update: dict[str, Any] = {"agents": own(stats.agents)}
        if stats.cache is not None:
            update["cache"] = stats.cache.model_copy(update={"steps_to_execution": own(stats.cache.steps_to_execution)})
        if stats.audit is not None:  # totals are the engine's; per-agent agreement only of the tenant's agents
            update["audit"] = stats.audit.model_copy(update={"agents": own(stats.audit.agents)})
        if stats.cluster is not None:
            workers = [w.model_copy(update={"stats": None if w.stats is None else self._own_stats(tenant, w.stats)})
                       for w in stats.cluster.workers]
            mine = self.owners.mine(tenant, [d.handle for d in stats.cluster.decisions])
            decisions = [d for d in stats.cluster.decisions if d.handle in mine]
            update["cluster"] = stats.cluster.model_copy(update={"workers": workers, "decisions": decisions})
        return stats.model_copy(update=update)

    def events(self, tenant: str, since: int) -> Events:
        """The engine's events after ``since`` that are the tenant's, by its own agent names: on a
        multi-tenant server, requests of its agents (agentless ones when it made their handle), and the
        shared pool's evictions with only its own agents' steps-to-execution; ``next`` is the
        engine's, so a tenant pages through the same sequence numbers."""
        page = self.engine.events(since)
        if not self.multi_tenant:
            return page
        made = self.owners.mine(tenant, [e.handle_out for e in page.events if e.agent is None and e.handle_out])
        mine: list[Event] = []
        for event in page.events:
            if event.kind == "evict":
                ste = {own: v for a, v in event.steps_to_execution.items() if (own := self.names.own_name(tenant, a))}
                # The pool is shared: every tenant sees evictions (as it sees the pool's counters in
                # stats), but only its own agents' steps-to-execution.
                mine.append(event.model_copy(update={"steps_to_execution": ste}))
            elif event.agent is None:
                if event.handle_out in made:
                    mine.append(event.model_copy(update={"tenant": tenant}))
            elif (own := self.names.own_name(tenant, event.agent)) is not None:  # "": its agentless request
                mine.append(event.model_copy(update={"agent": own or None, "tenant": tenant}))
        return page.model_copy(update={"events": mine})

    def hints(self, tenant: str, steps: Mapping[str, float], running: Sequence[str]) -> dict[str, float]:
        """Set the tenant's steps-to-execution; the engine gets every tenant's hints together."""
        mine = {name: v for a, v in ste_map(steps, running).items() if a and (name := self.agent(tenant, a)) is not None}
        with self._hints_lock:
            merged = {a: v for t, hs in self._hints.items() if t != tenant for a, v in hs.items()}
            merged.update(mine)
            result = self.engine.hints(merged)
            self._hints[tenant] = mine
        return {own: v for a, v in result.items() if (own := self.names.own_name(tenant, a))}

    def sampling(self, fields: Mapping[str, Any]) -> SamplingParams:
        """Validated sampling parameters within the server's ``max_tokens`` cap."""
        params = sampling_params(None, dict(fields))
        if params.max_tokens > self.max_tokens:
            raise InvalidRequest(f"max_tokens {params.max_tokens} exceeds the server's limit of {self.max_tokens}")
        return params
