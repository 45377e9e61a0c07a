"""``Stats`` assembled from the counters each part keeps: of one engine, and of a cluster.

Of an engine: the pool says what is used, the KV manager where attached blocks came from, the
request lifecycle how many tokens were reused, prefilled and generated; the caller holds the engine
lock, so the numbers are one consistent snapshot. Of a cluster: the workers' own stats summed, with
the placement decisions and the calibration of its cost model.

The one counter kept here, :class:`AgentLatencies` (the TTFTs per agent), is bounded whatever the
traffic: the last :data:`TTFT_WINDOW` samples of each of the :data:`MAX_AGENTS` most recently seen
agents, so a stream of fresh agent names cannot grow the engine's memory or the stats it builds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbaton.types import AgentStats, CacheStats, ClusterStats, Stats, WorkerStats

if TYPE_CHECKING:
    from .costmodel import CostModel
    from .kv_manager import KVManager
    from .lifecycle import RequestCounters
    from .loader import LoadedModel
    from .worker import WorkerClient

TTFT_WINDOW = 1024  # samples per agent behind ttft_mean_s and ttft_p90_s
MAX_AGENTS = 1024  # agents with stats; the least recently seen goes first


@dataclass
class _Agent:
    requests: int = 0
    ttft: deque[float] = field(default_factory=deque)


class AgentLatencies:
    """Time to first token per agent: a sliding window per agent, a bounded set of agents (LRU)."""

    def __init__(self, window: int = TTFT_WINDOW, max_agents: int = MAX_AGENTS) -> None:
        self.window = window
        self.max_agents = max_agents
        self._agents: OrderedDict[str, _Agent] = OrderedDict()

    def record(self, agent: str, ttft: float) -> None:
        entry = self._agents.get(agent)
        if entry is None:
            entry = self._agents[agent] = _Agent(ttft=deque(maxlen=self.window))
            if len(self._agents) > self.max_agents:
                self._agents.popitem(last=False)
        else:
            self._agents.move_to_end(agent)
        entry.requests += 1
        entry.ttft.append(ttft)

    def __len__(self) -> int:
        return len(self._agents)

    def summary(self) -> dict[str, AgentStats]:
        """Per agent: requests since it was last (re)admitted to the table, TTFT mean and p90 of the window."""
        return {
            name: AgentStats(requests=a.requests, ttft_mean_s=sum(a.ttft) / len(a.ttft), ttft_p90_s=_p90(a.ttft))
            for name, a in self._agents.items()
        }


_SUMMED = (
    "blocks_total", "blocks_used", "blocks_free", "blocks_shared", "blocks_cached", "blocks_cache_only",
    "pool_bytes_total", "pool_bytes_used", "pool_bytes_free", "tokens_reused", "tokens_prefilled", "tokens_generated",
    "tokens_approximate",
)


def engine_stats(
    loaded: LoadedModel, kv: KVManager, requests: RequestCounters, handles_live: int, ste: Mapping[str, float]
) -> Stats:
    pool = kv.pool
    bpb = pool.shape.bytes_per_block
    cached = kv.cache.cached_blocks() if kv.cache is not None else set()
    return Stats(
        model=loaded.name,
        device=str(pool.device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        block_size=pool.block_size,
        blocks_total=pool.num_blocks,
        blocks_used=pool.num_used,
        blocks_free=pool.num_free,
        bytes_per_block=bpb,
        pool_bytes_total=pool.num_blocks * bpb,
        pool_bytes_used=pool.num_used * bpb,
        pool_bytes_free=pool.num_free * bpb,
        handles_live=handles_live,
        tokens_reused=requests.tokens_reused,
        tokens_prefilled=requests.tokens_prefilled,
        tokens_generated=requests.tokens_generated,
        tokens_approximate=requests.tokens_approximate,
        # Blocks referenced by more than one handle or request (the cache's own reference aside).
        blocks_shared=sum(1 for b in range(pool.num_blocks) if pool.refcount(b) - (b in cached) > 1),
        blocks_cached=len(cached),
        blocks_cache_only=sum(1 for b in cached if pool.refcount(b) == 1),
        cache=_cache_stats(kv, ste),
        agents=requests.ttft.summary(),
    )


def _cache_stats(kv: KVManager, ste: Mapping[str, float]) -> CacheStats | None:
    cache = kv.cache
    if cache is None:
        return None
    counters, bpb = kv.counters, kv.pool.shape.bytes_per_block
    prefetched = counters.prefetched
    return CacheStats(
        policy=cache.policy.name,
        tiers=[t.name for t in cache.tiers],
        hits_blocks=dict(counters.hits),
        nodes_on_device=cache.device_nodes,
        nodes_per_tier={t.name: cache.nodes_in_tier(i) for i, t in enumerate(cache.tiers)},
        bytes_offloaded=cache.bytes_offloaded,
        bytes_prefetched=prefetched * bpb,
        bytes_loaded_on_demand=counters.loaded_on_demand * bpb,
        blocks_prefetched=prefetched,
        prefetch_hits=counters.prefetch_hits,
        prefetch_hit_rate=counters.prefetch_hits / prefetched if prefetched else 0.0,
        tier_errors=cache.tier_errors,
        handles_spilled=kv.spiller.handles_spilled,
        steps_to_execution=dict(ste),
    )


def cluster_stats(
    workers: Sequence[WorkerClient], per: Mapping[int, Stats], held: Mapping[int, int], costs: CostModel,
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


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
