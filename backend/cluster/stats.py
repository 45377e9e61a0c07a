"""A cluster's ``Stats``: its workers' own stats summed, with the placement decisions and the
calibration of its cost model. Reads a worker through :class:`Worker` (the coordinator's
``WorkerClient``), so the worker module is not imported here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvbaton.types import ClusterStats, Stats, WorkerStats

from .costmodel import CostModel


class Worker(Protocol):
    """What the stats of a cluster read of one worker (the coordinator's ``WorkerClient``)."""

    rank: int
    device: str
    alive: bool
    pid: int | None
    host: str | None

    @property
    def queue(self) -> int: ...


_SUMMED = (
    "blocks_total", "blocks_used", "blocks_free", "blocks_shared", "blocks_cached", "blocks_cache_only",
    "pool_bytes_total", "pool_bytes_used", "pool_bytes_free", "tokens_reused", "tokens_prefilled", "tokens_generated",
    "tokens_approximate", "tokens_discarded", "tokens_recomputed",
)



def cluster_stats(
    workers: Sequence[Worker], per: Mapping[int, Stats], held: Mapping[int, int], costs: CostModel,
    bandwidth_cap: float | None, retries: int, handles_live: int,
) -> Stats:
    """The workers' stats (``per`` rank, of those that answered) as one, with ``Stats.cluster``."""
    cal = costs.calibration
    cluster = ClusterStats(
        workers=[
            WorkerStats(
                rank=w.rank, device=w.device, alive=w.alive, pid=w.pid, host=w.host, queue=w.queue,
                handles=held[w.rank], stats=per.get(w.rank),
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

