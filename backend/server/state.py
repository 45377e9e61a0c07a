"""``ServerState``: everything the endpoints share — the engine, tenancy, limits, metrics, threads.

The engine is any :class:`..hosting.HostedEngine` (``Engine``, ``Cluster``, ``SglangEngine``); the
state calls it directly, through that contract only. Invariants: engine calls block, so endpoints
make them through ``run`` (a bounded pool of worker threads), never on the event loop; every handle
a request makes is recorded for its tenant as soon as it exists (``record``), and every release goes
through the state so that owners and agent slots forget the id; a request is admitted within its
tenant's quota (``admit``) before the engine runs it; every operation naming a handle restarts its
idle time (``check_owned``), and ``sweep`` releases handles idle longer than the TTL; the engine gets
every tenant's hints at once, and a tenant's stats show only its own agents; on a multi-tenant
server a request's cross-prefix reuse places only its own tenant's spans (unless shared
explicitly), and where the engine cannot partition them every request runs ``"exact"``; a request
reuses only its own tenant's prefix-cache blocks (unless shared explicitly), and an engine that
cannot keep them apart is refused (both are the engine's :class:`..tenants.TenantPartition`, set
once here; the tenant travels with each request as an :class:`..tenants.AgentRef`). With a
persistent engine (``Engine(persist=True)``), ``record``, ``retained`` and every release also go to
its handle journal (:mod:`..cache.persist`), durably before the answer (the event loop awaits the
journal's commit, ``recorded``: it never waits on the disk itself), and the journal's handles are
their tenants' (and their slots') again at start. While the journal cannot be written the server is
``degraded``: the requests that make handles fail with 503 ``server_unavailable`` (their handles
released), every other request is served.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import anyio
import anyio.to_thread
from kvbaton.client import sampling_params
from kvbaton.errors import HandleNotFound, HandleReleased, InvalidRequest, ServerUnavailable
from kvbaton.handle import Handle
from kvbaton.ops import ste_map
from kvbaton.types import Event, Events, Reuse, SamplingParams, Stats

from ..cache.block_pool import blocks_for_budget
from ..cache.persist import COMMIT_TIMEOUT_S
from ..hosting import HostedEngine
from ..tenants import AgentRef, TenantPartition
from . import protocol as p
from .args import FALLBACK_MAX_TOKENS, ServerArgs
from .concurrency import Concurrency
from .eventviews import EventViews
from .grammar import check_format
from .metrics import Metrics
from .tenancy import SINGLE_TENANT, Admission, AgentNames, AgentSlots, Owners, Quota, RegisteredAgents, SlotKey

T = TypeVar("T")
log = logging.getLogger(__name__)
MAX_FORK = 65536  # children of one fork without a live-handle quota (each is a handle's host objects)


def ref_id(ref: p.HandleRef) -> str:
    return ref.id if isinstance(ref, Handle) else ref


class ServerState:
    """Everything the endpoints share: the engine, tenancy, limits, metrics."""

    def __init__(self, engine: HostedEngine, *, tenants: Mapping[str, str], args: ServerArgs | None = None,
                 concurrency: Concurrency | None = None, fallback_max_tokens: int = FALLBACK_MAX_TOKENS,
                 **options: Any) -> None:
        """``args`` (and/or its fields as keywords: ``ServerState(engine, tenants=..., max_n=1)``) are
        every limit and default the endpoints read (``self.args``)."""
        args = self.args = ServerArgs.of(args, **options)
        max_kv_bytes_per_tenant = args.max_kv_bytes_per_tenant
        self.engine = engine
        self.tenants = tenants
        self.multi_tenant = bool(tenants)
        self.names = AgentNames(self.multi_tenant)
        self.default_reuse = args.reuse or engine.default_reuse
        # What an OpenAI request that sets no temperature / top_p / top_k samples with: the checkpoint's
        # generation_config.json defaults where it has them (as vLLM serves them), else greedy.
        self.sampling_defaults: dict[str, Any] = dict(getattr(engine, "sampling_defaults", None) or {})
        self.cross_prefix = self._partition(args.shared_spans, args.shared_prefix_cache)
        first = engine.stats()
        # The names the OpenAI routes report (the first in answers); the engine's own name by default.
        self.model_names: list[str] = list(args.served_model_names or [engine.model_name])
        self.model = self.model_names[0]
        self.max_context: int | None = engine.max_context
        # max_tokens caps every request (default: the model's context); default_max_tokens applies to
        # requests that give none, on every route.
        self.max_tokens = args.max_tokens or self.max_context or fallback_max_tokens
        self.default_max_tokens = min(args.default_max_tokens, self.max_tokens)
        self.max_n = args.max_n
        self.threads = args.threads
        self.handle_ttl = args.handle_ttl
        self.owners = Owners(Quota(
            max_handles=args.max_handles_per_tenant or None,
            max_kv_bytes=(blocks_for_budget(max_kv_bytes_per_tenant, first.bytes_per_block) * first.bytes_per_block
                          if max_kv_bytes_per_tenant else None),
            bytes_per_token=first.bytes_per_block / first.block_size,
            max_handle_tokens=args.max_handle_tokens_per_tenant or None,
        ), lookup=getattr(engine, "handle_owner", None))  # a cluster several servers serve: their handles too
        self.slots = AgentSlots(args.max_agents)
        self.registered = RegisteredAgents(args.max_registered_agents or None)
        # A persistent engine's handles of an earlier run: their tenants own them again.
        self.journal = engine.persistence.journal if engine.persistence is not None else None
        for entry in self.journal.live() if self.journal is not None else ():
            tenant = entry.owner or SINGLE_TENANT
            self.owners.add(tenant, [(entry.handle.id, entry.handle.num_tokens)])
            if entry.slot is not None:
                self.slots.slot((tenant, entry.session, entry.slot)).replace(entry.handle.id)
        # Requests in flight and open streams (create_app's limits; by default the threads' own).
        self.concurrency = concurrency or Concurrency.of_server(args, tenants=len(set(tenants.values())))
        self.max_fidelity_tokens = args.max_fidelity_tokens or None
        self.views = EventViews(engine.events, self._route_event, renumber=self.multi_tenant)
        self.metrics = Metrics(engine.stats, engine.events, self._tenant_and_agent, usage=self.usage)
        self._hints_lock = threading.Lock()
        self._hints: dict[str, dict[str, float]] = {}  # tenant -> {engine agent name: steps}
        self._limiter: anyio.CapacityLimiter | None = None
        # Set when the server begins to shut down: generations in flight end at their next token
        # (503 server_unavailable, in-band for a stream) instead of being cancelled mid-answer.
        self.draining = False

    def _partition(self, shared_spans: bool, shared_prefix_cache: bool) -> bool:
        """Set the engine's tenant partition; whether cross-prefix reuse may run at all.

        With several tenants each keeps its prefix-cache blocks to itself (a tenant must not learn
        from its reuse, or its time to first token, what another sent) unless ``shared_prefix_cache``:
        an engine that cannot is refused rather than silently shared. With tokens each tenant's
        requests place only its own spans unless ``shared_spans``: where the engine cannot keep them
        apart (a ``Cluster``), cross-prefix reuse is off. Set either way: the engine may have served
        another app before."""
        cache = len(set(self.tenants.values())) > 1 and not shared_prefix_cache  # one token: nothing to keep apart
        spans = self.multi_tenant and not shared_spans
        possible = self.engine.partitionable
        if cache and not possible.prefix_cache:
            raise InvalidRequest(
                f"this engine ({type(self.engine).__name__}) cannot keep tenants' prefix caches apart: serve one "
                "token, or share the prefix cache across tenants explicitly (--shared-prefix-cache)"
            )
        cross_prefix = not spans or possible.spans
        if not cross_prefix and self.default_reuse != "exact":
            log.warning("cross-prefix reuse is off: this engine (%s) cannot keep tenants' spans apart; "
                        "--shared-spans allows it across tenants", type(self.engine).__name__)
        self.engine.partition_tenants(TenantPartition(prefix_cache=cache, spans=spans and cross_prefix))
        return cross_prefix

    def _tenant_and_agent(self, label: str) -> tuple[str, str]:
        """The (tenant id, the tenant's own agent name) of an agent as the engine shows it ("": none), for
        metric labels; with tokens, tenant "unknown" for one without a tenant (not a request's)."""
        if not self.multi_tenant:
            return SINGLE_TENANT, label
        ref = AgentRef.parse(label)
        if ref.tenant is None:
            return "unknown", label
        return ref.tenant, ref.name or ""

    def reuse(self, requested: Reuse | None) -> Reuse:
        """The reuse policy a request runs with: its own, else the server's default; always ``"exact"``
        where cross-prefix reuse is off (see ``_partition_spans``)."""
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
        of them. Handles released right after (a dropped stream's) need not be. Waits for the journal:
        call it in a worker thread (the event loop awaits :meth:`recorded`)."""
        handles = list(handles)
        pending = self._own(tenant, handles, durable)
        if pending is not None and self.journal is not None:
            try:
                self.journal.wait(pending)
            except OSError as exc:
                self._unjournaled(handles, exc)

    async def recorded(self, tenant: str, handles: Iterable[Handle]) -> None:
        """:meth:`record` (durable) on the event loop: awaits the journal's commit, blocking neither the
        loop nor a worker thread while the journal's writer writes."""
        handles = list(handles)
        pending = self._own(tenant, handles, True)
        if pending is None:
            return
        try:
            with anyio.fail_after(COMMIT_TIMEOUT_S, shield=True):  # a cancelled request still learns the outcome
                await asyncio.wrap_future(pending)
        except (OSError, TimeoutError) as exc:
            await self.run(self._unjournaled, handles, exc)

    def _own(self, tenant: str, handles: list[Handle], durable: bool) -> concurrent.futures.Future[None] | None:
        """The tenant owns the handles now; their journal commit, when they are to be journaled."""
        self.owners.add(tenant, [(h.id, h.num_tokens) for h in handles])
        if not durable or self.journal is None:
            return None
        return self.journal.submit_add(tenant, handles)

    def _unjournaled(self, handles: list[Handle], exc: BaseException) -> NoReturn:
        """Refuse, rather than hand out handles a restart would lose: release them, answer 503."""
        self.release_quietly([h.id for h in handles])
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or "the handle journal timed out"
        raise ServerUnavailable(f"{why}: the request's handles were released; retry later") from exc

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

    def check_fork(self, k: int) -> None:
        """400 for a fork that can never be admitted, whatever the tenant releases: more children than
        its live-handle quota (or, without one, than :data:`MAX_FORK`), so the client is told to change
        the request rather than retry it (a 429 says "release first")."""
        limit = self.owners.quota.max_handles
        bound, why = (limit, "the tenant's quota of live handles (--max-handles-per-tenant)") if limit else (
            MAX_FORK, "the server's largest fork")
        if k > bound:
            raise InvalidRequest(f"Invalid value for 'k': {k} children can never be admitted: at most {bound}, "
                                 f"{why}.", param="k")

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

    def release_undelivered(self, handle_ids: list[str]) -> None:
        """Release the handles an answer would have given a client that left before it was sent
        (:mod:`.delivery`): no one else knows their ids."""
        self.slots.forget(set(handle_ids))
        self.release_quietly(handle_ids)
        log.info("released %d handle(s) of a request whose client left before its answer", len(handle_ids))

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

    def degraded(self) -> str | None:
        """Why only part of the requests can be served now (None: all can): the handle journal cannot be
        written, so the requests that make handles fail until it can."""
        return self.journal.failure if self.journal is not None else None

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
    def registered_agent(self, tenant: str, agent: AgentRef | None) -> None:
        """The tenant registered ``agent``: beyond its limit its least recently registered agents are
        unregistered from the engine (:class:`.tenancy.RegisteredAgents`)."""
        if agent is None:
            return
        for dropped in self.registered.add(tenant, agent):
            self.engine.unregister_agent(dropped)

    def unregister_agent(self, tenant: str, name: str) -> bool:
        """Unregister the tenant's agent ``name``; whether the tenant had registered it."""
        agent = self.agent(tenant, name)
        if agent is None or not self.registered.remove(tenant, agent):
            return False
        self.engine.unregister_agent(agent)
        return True

    def check_fidelity(self, max_tokens: int) -> None:
        """``InvalidRequest`` unless a fidelity check of ``max_tokens`` generated tokens stays within
        ``max_fidelity_tokens``: it holds both sides' logits over the whole vocabulary for every one of
        them on the host (about 1 MiB a token with the default model)."""
        if self.max_fidelity_tokens is not None and max_tokens > self.max_fidelity_tokens:
            raise InvalidRequest(
                f"a fidelity check of {max_tokens} tokens is over the server's limit of {self.max_fidelity_tokens} "
                "(--max-fidelity-tokens): it keeps full logits of every token", param="max_tokens"
            )

    def agent(self, tenant: str, agent: str | None, session: str | None = None) -> AgentRef | None:
        """Whose a tenant's request is, for the engine: tenants share the engine, not agent names; its
        ``session`` bounds the request's approximate reuse."""
        return self.names.agent(tenant, agent, session)

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
        """The tenant's events after ``since``: the engine's new events are routed first (calls the
        engine: off the event loop). On a multi-tenant server, requests of its agents (agentless ones
        when it made their handle), and the shared pool's evictions with only its own agents'
        steps-to-execution, numbered in the tenant's own sequence (:mod:`.eventviews`)."""
        self.views.pump()
        return self.views.page(tenant, since)

    def _route_event(self, event: Event) -> list[tuple[str, Event]]:
        """Whose ``event`` is, and how each of them sees it (:class:`.eventviews.EventViews`' route)."""
        if not self.multi_tenant:
            return [(SINGLE_TENANT, event)]
        if event.kind == "evict":
            # The pool is shared: every tenant sees evictions (as it sees the pool's counters in stats),
            # but only its own agents' steps-to-execution.
            out = []
            for tenant in sorted(set(self.tenants.values())):
                ste = {own: v for a, v in event.steps_to_execution.items()
                       if (own := self.names.own_name(tenant, a))}
                out.append((tenant, event.model_copy(update={"steps_to_execution": ste})))
            return out
        if event.agent is None:
            owner = self.owners.owner(event.handle_out) if event.handle_out else None
            return [(owner, event.model_copy(update={"tenant": owner}))] if owner is not None else []
        ref = AgentRef.parse(event.agent)
        if ref.tenant is None:
            return []
        return [(ref.tenant, event.model_copy(update={"agent": ref.name or None, "tenant": ref.tenant}))]

    def usage(self) -> dict[str, dict[str, int]]:
        """What each tenant holds now, for the metrics (:data:`.metrics.TENANT_GAUGES`)."""
        tenants = set(self.tenants.values()) or {SINGLE_TENANT}
        out = {}
        for tenant in sorted(tenants | set(self.concurrency.tenants())):
            handles, tokens = self.owners.holding(tenant)
            running, waiting, streams = self.concurrency.usage(tenant)
            out[tenant] = {"handles_live": handles, "handle_tokens": tokens, "requests_running": running,
                           "requests_waiting": waiting, "streams_open": streams,
                           "agents_registered": self.registered.count(tenant)}
        return out

    def hints(self, tenant: str, steps: Mapping[str, float], running: Sequence[str]) -> dict[str, float]:
        """Set the tenant's steps-to-execution; the engine gets every tenant's hints together."""
        mine = {ref.label: v for a, v in ste_map(steps, running).items() if a and (ref := self.agent(tenant, a))}
        with self._hints_lock:
            merged = {a: v for t, hs in self._hints.items() if t != tenant for a, v in hs.items()}
            merged.update(mine)
            result = self.engine.hints(merged)
            self._hints[tenant] = mine
        return {own: v for a, v in result.items() if (own := self.names.own_name(tenant, a))}

    def sampling(self, fields: Mapping[str, Any]) -> SamplingParams:
        """Validated sampling parameters within the server's ``max_tokens`` cap."""
        params = sampling_params(None, dict(fields))
        check_format(params.response_format)  # one the grammar engine would give up on: 400 now, not 500 later
        if params.max_tokens > self.max_tokens:
            raise InvalidRequest(f"Invalid value for 'max_tokens': {params.max_tokens} exceeds the server's limit of "
                                 f"{self.max_tokens}.", param="max_tokens")
        return params
