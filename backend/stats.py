"""``Stats`` of one engine, assembled from the counters each part keeps.

The pool says what is used, the KV manager where attached blocks came from, the request counters
(:mod:`.runtime.counters`) how many tokens were reused, prefilled and generated and the TTFTs per
agent; the caller holds the engine lock, so the numbers are one consistent snapshot. A cluster's are
its workers' summed (:mod:`.cluster.stats`).

Below the engine and the lifecycle: it reads the request counters from their own leaf module, so
neither is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvbaton.types import CacheStats, Stats

if TYPE_CHECKING:
    from .cache.kv_manager import KVManager
    from .compute.loader import LoadedModel
    from .runtime.counters import RequestCounters


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
        tokens_discarded=requests.tokens_discarded,
        tokens_recomputed=requests.tokens_recomputed,
        # Blocks referenced by more than one handle or request (the cache's own reference aside).
        blocks_shared=sum(1 for b in range(pool.num_blocks) if pool.refcount(b) - (b in cached) > 1),
        blocks_cached=len(cached),
        blocks_cache_only=sum(1 for b in cached if pool.refcount(b) == 1),
        blocks_retained_only=kv.retained_only_blocks(),
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
        tier_capacity_blocks={t.name: t.capacity for t in cache.tiers},
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
