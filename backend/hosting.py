"""The hosted-engine contract: what a server and a cluster use of an engine beyond its operators.

:class:`kvbaton.ops.EngineOps` is the operators plus ``describe``, ``max_context`` and ``healthy``.
A server (:mod:`.server`) also reads the model's name and the reuse policy of requests that name
none, keeps tenants apart in the prefix cache and the span index, and journals the handles of a
persistent engine: :class:`HostedEngine` declares these, and ``Engine``, ``Cluster`` and
``SglangEngine`` implement it. A cluster's coordinator calls a few more methods on its workers'
engines (:class:`WorkerEngine`, by name: :data:`WORKER_CALLS`). tests/test_ops_contract_static.py
checks every implementation against these Protocols without loading a model.

Tenants travel as a typed field (:mod:`.tenants`): a request's agent is an :class:`~.tenants.AgentRef`
(tenant, name), across a cluster's control connection too, and the engine derives the request's
prefix-cache partition and span partition from its tenant as the engine's :class:`~.tenants.TenantPartition`
says. Where an engine shows agents (events, stats, steps-to-execution, the cache's agent registry) it
shows an AgentRef's ``label``, ``tenant/name``; a multi-tenant server's views read a label back with
:meth:`~.tenants.AgentRef.parse`.

Invariants: an engine's operators take an agent as a plain name (``str``: no tenant) or an
``AgentRef``; a tenant is a non-empty string without ``/`` (checked when an ``AgentRef`` is made), an
agent's label is checked where the engine has always checked agent names (a bad one fails its
request); a request without a tenant uses no structure that is partitioned per tenant (it neither
reads nor feeds it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvbaton.errors import InvalidRequest
from kvbaton.handle import Handle
from kvbaton.ops import EngineOps

from .tenants import Agent, TenantPartition

HEALTHY = "ok"  # the reason ``healthy()`` gives when it serves fully (any other reason with True: degraded)

if TYPE_CHECKING:
    import torch
    from kvbaton.types import Reuse

    from .cache.persist import Persistence
    from .config import EngineConfig


@runtime_checkable
class HostedEngine(EngineOps, Protocol):
    """What a server uses of the engine it hosts, beyond :class:`kvbaton.ops.EngineOps`."""

    @property
    def model_name(self) -> str:
        """The model's own name (``/v1/models`` and answers name it unless the server renames it)."""
        ...

    @property
    def default_reuse(self) -> Reuse:
        """The reuse policy of requests that name none (a server's own default overrides it)."""
        ...

    @property
    def partitionable(self) -> TenantPartition:
        """What this engine can keep apart per tenant: a server refuses to share a prefix cache it
        must partition, and serves every request ``"exact"`` when it cannot partition spans."""
        ...

    def partition_tenants(self, partition: TenantPartition) -> None:
        """Keep tenants apart as ``partition`` says from now on (``InvalidRequest`` beyond
        :attr:`partitionable`). Changing the prefix cache's partition drops what it holds: call it
        before serving."""
        ...

    @property
    def persistence(self) -> Persistence | None:
        """The state directory of a persistent engine (the tenant-id salt and the handle journal a
        server records its tenants' handles in); None when handles do not survive a restart."""
        ...


@runtime_checkable
class WorkerEngine(HostedEngine, Protocol):
    """What a cluster's coordinator calls on each worker's engine beyond :class:`HostedEngine`."""

    def adopt(
        self, handle: Handle, kv: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None, num_cached: int = 0,
        *, agent: Agent | None = None,
    ) -> Handle:
        """Register a handle moved in from another engine (its K/V given, or recomputed from lineage)."""
        ...

    def export_kv(self, handle: Handle | str) -> tuple[Handle, int, Iterator[tuple[torch.Tensor, torch.Tensor]]]:
        """A live handle's metadata, its cached token count and its blocks' K/V (for a move)."""
        ...

    def cached_prefix(self, tokens: Sequence[int], agent: Agent | None = None) -> int:
        """How many leading ``tokens`` the prefix cache holds for ``agent``'s requests (a move's cost)."""
        ...

    def flush_cache(self) -> None:
        """Drop every cached prefix not pinned by a live handle."""
        ...


class ConfiguredEngine:
    """The part of the hosted contract an engine of one :class:`~.config.EngineConfig` answers from it
    and from its loaded model (``Engine``, ``Cluster``: every worker runs the same model and config)."""

    config: EngineConfig
    loaded: Any  # the model: its ``name``

    @property
    def model_name(self) -> str:
        return str(self.loaded.name)

    @property
    def default_reuse(self) -> Reuse:
        return self.config.reuse


# The worker methods a coordinator may call by name beyond the operators (kvbaton.ops.OPERATORS).
WORKER_CALLS: frozenset[str] = frozenset({"describe", "adopt", "cached_prefix", "flush_cache", "partition_tenants"})


def check_partition(engine: Any, partition: TenantPartition, possible: TenantPartition) -> None:
    """``InvalidRequest`` when ``engine`` (which can keep ``possible`` apart) is asked for more."""
    if not partition.within(possible):
        raise InvalidRequest(f"this engine ({type(engine).__name__}) cannot keep tenants apart as {partition} asks "
                             f"(it can: {possible})")
