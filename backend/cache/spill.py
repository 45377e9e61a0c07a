"""Spilling idle live handles: a reservation's last resort before :class:`PoolExhausted`.

A live handle holds its blocks, so many idle handles could exhaust the pool although their K/V
could wait in a slow tier, or be recomputed from their tokens. When a reservation cannot be met
even after evicting the prefix cache, the KV manager asks the :class:`Spiller` for the missing
blocks, and it takes them from live handles that nothing is using.

Invariants:

- a spilled handle keeps its tokens and lineage and gives up every block (``num_cached`` 0). Its
  exact full blocks enter the prefix cache first, so the cache's own eviction moves them to the
  first slow tier (or drops them when there is none). Its next use (resume, extend, fork,
  generate, compose...) attaches whatever the cache still holds, on the device or loaded back
  from a tier, and prefills the rest densely: the result is token-identical to dense prefill;
- approximate handles (a rotated, blended or corrected composition) spill too: only their exact
  leading blocks enter the prefix cache, the approximate K/V are dropped, and the handle is rebuilt
  densely from its tokens (its lineage) on next use, so it is exact from then on (``exact_len``
  None). Approximate K/V cannot be recomputed identically and a content-addressed tier would serve
  them as exact, so they are never offloaded: a rebuild costs a prefill, never a wrong answer;
- private measurement states (``cacheable`` False) are never spilled, nor a handle whose blocks
  are pinned (a composition reading it as a source), nor one whose spilling frees nothing;
- candidates go in the eviction policy's order, each handle seen as a cache node whose owner is
  the handle's agent (its steps-to-execution) and whose last access is its last use (LRU);
- everything runs under the engine lock (inside ``reserve``), so no request sees a handle half
  spilled.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .eviction import LRU, EvictionPolicy
from .radix import RadixCache, RadixNode
from .sequence import KVState


@dataclass
class _AsNode:
    """A handle as the eviction policy sees a cache node."""

    last_access: int
    owners: set[str] = field(default_factory=set)


class Spiller:
    def __init__(
        self, pool: BlockPool, cache: RadixCache | None, live: Callable[[], Iterable[KVState]],
        partition: Callable[[KVState], str | None] = lambda state: "",
    ) -> None:
        self._pool = pool
        self._cache = cache
        self._partition_of_tenant = partition  # a state's prefix-cache partition: its spilled blocks stay in it
        self._policy: EvictionPolicy = cache.policy if cache is not None else LRU()
        self._live = live  # the engine's live handle states
        self._clock = itertools.count(1)
        self._used: dict[str, int] = {}  # handle id -> last use
        self.spilled: set[str] = set()  # live handles without their K/V on the device
        self.handles_spilled = 0

    def touch(self, state: KVState) -> None:
        """``state`` was just made or used: the most recently used handle goes last."""
        self._used[state.id] = next(self._clock)

    def last_used(self, state: KVState) -> int:
        """When ``state`` was last made or used, on the spiller's clock (0: never): larger is more recent."""
        return self._used.get(state.id, 0)

    def forget(self, state: KVState) -> None:
        self._used.pop(state.id, None)
        self.spilled.discard(state.id)

    def free(
        self, n: int, pinned: Collection[int], exclude: KVState, allowed: Callable[[RadixNode], bool] | None = None
    ) -> int:
        """Spill idle handles (policy order) until ``n`` more pool blocks are free; how many were freed.

        Nothing is spilled unless spilling every candidate would free ``n``. ``allowed`` limits
        which cache nodes the following eviction may take (a load-back keeps the path it loads)."""
        start = self._pool.num_free
        candidates = [s for s in self._live() if s is not exclude and self._spillable(s, pinned)]
        cached = self._cached()
        if _freeable(self._pool, candidates, cached) < n:
            return 0  # the reservation fails anyway: spill nothing for it
        candidates.sort(key=lambda s: self._policy.priority(_AsNode(self._used.get(s.id, 0), _owners(s))))
        for state in candidates:
            if self._pool.num_free - start >= n:
                break
            if self._frees_any(state, cached):
                self._spill(state)
                if self._cache is not None:  # its blocks are cache-only now: offload (or drop) them
                    self._cache.evict(n - (self._pool.num_free - start), allowed)
                cached = self._cached()
        return self._pool.num_free - start

    def _spillable(self, state: KVState, pinned: Collection[int]) -> bool:
        return bool(state.blocks) and state.cacheable and not any(b in pinned for b in state.blocks)

    def _frees_any(self, state: KVState, cached: set[int]) -> bool:
        """Whether dropping the handle's references frees a block (now, or once the cache evicts it)."""
        return any(self._pool.refcount(b) - (b in cached) <= 1 for b in state.blocks)

    def _cached(self) -> set[int]:
        return self._cache.cached_blocks() if self._cache is not None else set()

    def _spill(self, state: KVState) -> None:
        partition = self._partition_of_tenant(state)
        exact = state.num_cached if state.exact_len is None else min(state.num_cached, state.exact_len)
        if self._cache is not None and partition is not None:  # None: a state that may not feed the cache
            self._cache.insert(state.token_ids, state.blocks, exact // self._pool.block_size, partition)
        self._pool.decref(state.blocks)
        state.blocks = []
        state.num_cached = 0
        state.last_logits = None
        state.exact_len = None  # approximate K/V are gone: the next use rebuilds them densely (exact)
        self.spilled.add(state.id)
        self.handles_spilled += 1


def _freeable(pool: BlockPool, states: Sequence[KVState], cached: set[int]) -> int:
    """Blocks that spilling all ``states`` would free: those no one else (but the cache) holds."""
    refs = Counter(b for s in states for b in s.blocks)
    return sum(1 for b, r in refs.items() if pool.refcount(b) - (b in cached) == r)


def _owners(state: KVState) -> set[str]:
    return {state.agent} if state.agent else set()
