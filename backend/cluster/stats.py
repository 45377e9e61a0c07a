"""A cluster's ``Stats``: its workers' own stats summed, with the placement decisions and the
calibration of its cost model. Reads a worker through :class:`Worker` (the control's ``WorkerRef``),
so the worker module is not imported here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvbaton.types import ClusterStats, Stats, WorkerStats

from .costmodel import CostModel
from .moves import Group
from .placement import Placer


class Worker(Protocol):
    """What the stats of a cluster read of one worker (the control's ``WorkerRef``)."""

    rank: int
    device: str
    alive: bool

    @property
    def pid(self) -> int | None: ...

    @property
    def host(self) -> str | None: ...


_SUMMED = (
    "blocks_total", "blocks_used", "blocks_free", "blocks_shared", "blocks_cached", "blocks_cache_only",
    "pool_bytes_total", "pool_bytes_used", "pool_bytes_free", "tokens_reused", "tokens_prefilled", "tokens_generated",
    "tokens_approximate", "tokens_discarded", "tokens_recomputed",
)



def cluster_stats(
    workers: Sequence[Worker], per: Mapping[int, Stats], held: Mapping[int, int], placer: Placer,
    group: Group | None, costs: CostModel, bandwidth_cap: float | None, retries: int, handles_live: int,
) -> Stats:
    """The workers' stats (``per`` rank, of those that answered) as one, with ``Stats.cluster``; a
    worker's ``queue`` is the requests in flight the router placed on it."""
    cal = costs.calibration
    cluster = ClusterStats(
        workers=[
            WorkerStats(
                rank=w.rank, device=w.device, alive=w.alive, pid=w.pid, host=w.host, queue=placer.load(w),
                handles=held[w.rank], stats=per.get(w.rank),
                collective=w.rank in group.members if group is not None else None,
                prefill_tokens_per_s=(1 / cal.prefill_per_token_s[w.rank])
                if cal and cal.prefill_per_token_s.get(w.rank) else None,
            )
            for w in workers
        ],
        bandwidth_bytes_per_s=cal.bandwidth_bytes_per_s if cal else None,
        latency_s=cal.latency_s if cal else None,
        bandwidth_cap_bytes_per_s=bandwidth_cap,
        transfers=costs.transfers,
        recomputes=costs.recomputes,
        retries=retries,
        decisions=list(costs.decisions),
    )
    first = next(iter(per.values()))
    agents: dict[str, Any] = {}
    for s in per.values():
        for name, value in s.agents.items():
            agents.setdefault(name, value)
    return Stats(
        model=first.model, device=",".join(w.device for w in workers), dtype=first.dtype,
        block_size=first.block_size, bytes_per_block=first.bytes_per_block,
        **{f: sum(getattr(s, f) for s in per.values()) for f in _SUMMED},
        handles_live=handles_live, agents=agents, cluster=cluster,
    )

