"""Spilling idle live handles: one kind of kept KV (:mod:`.store`) a reservation short of blocks may take.

A live handle holds its blocks, so many idle handles could exhaust the pool although their K/V
could wait in a slow tier, or be recomputed from their tokens. When a reservation is short, the one
owner of kept KV (:class:`~.store.KeptKV`) ranks idle handles with the prefix cache's blocks and the
retained states in one order, and spills the handles it takes through the :class:`Spiller`.

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
- the store ranks each handle as a cache node whose owner is the handle's agent (its
  steps-to-execution) and whose last access is its last use, on the prefix cache's clock: its spilled
  blocks keep that last use in the cache, so they go where the handle would have gone;
- everything runs under the engine lock (inside ``reserve``), so no request sees a handle half
  spilled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable

from .block_pool import BlockPool
from .radix import RadixCache, RadixNode
from .sequence import KVState


class Spiller:
    def __init__(
        self, pool: BlockPool, cache: RadixCache | None, live: Callable[[], Iterable[KVState]],
        partition: Callable[[KVState], str | None] = lambda state: "",
    ) -> None:
        self._pool = pool
        self._cache = cache
        self._partition_of_tenant = partition  # a state's prefix-cache partition: its spilled blocks stay in it
        self._live = live  # the engine's live handle states
        # One clock with the prefix cache: a spilled handle's blocks keep its last use there (store.py ranks both).
        self._clock = cache.tick if cache is not None else itertools.count(1).__next__
        self._used: dict[str, int] = {}  # handle id -> last use
        self.spilled: set[str] = set()  # live handles without their K/V on the device
        self.handles_spilled = 0

    def touch(self, state: KVState) -> None:
        """``state`` was just made or used: the most recently used handle goes last."""
        self._used[state.id] = self._clock()

    def last_used(self, state: KVState) -> int:
        """When ``state`` was last made or used, on the spiller's clock (0: never): larger is more recent."""
        return self._used.get(state.id, 0)

    def forget(self, state: KVState) -> None:
        self._used.pop(state.id, None)
        self.spilled.discard(state.id)

    def candidates(self, pinned: Collection[int], exclude: KVState | None = None) -> list[KVState]:
        """The live handles that spilling would free blocks of (not ``exclude``, the one reserving)."""
        cached = self._cache.cached_blocks() if self._cache is not None else set()
        return [s for s in self._live() if s is not exclude and self._spillable(s, pinned) and self._frees_any(s, cached)]

    def spill(self, state: KVState) -> list[RadixNode] | None:
        """Spill an idle handle (see the module): the cache nodes that hold its exact blocks now (None: it was not
        spilled, having no blocks any more)."""
        if not state.blocks:
            return None
        return self._spill(state)

    def _spillable(self, state: KVState, pinned: Collection[int]) -> bool:
        return bool(state.blocks) and state.cacheable and not any(b in pinned for b in state.blocks)

    def _frees_any(self, state: KVState, cached: set[int]) -> bool:
        """Whether dropping the handle's references frees a block (now, or once the cache evicts it)."""
        return any(self._pool.refcount(b) - (b in cached) <= 1 for b in state.blocks)

    def _spill(self, state: KVState) -> list[RadixNode]:
        partition = self._partition_of_tenant(state)
        exact = state.num_cached if state.exact_len is None else min(state.num_cached, state.exact_len)
        full = exact // self._pool.block_size
        path: list[RadixNode] = []
        if self._cache is not None and partition is not None:  # None: a state that may not feed the cache
            self._cache.insert(state.token_ids, state.blocks, full, partition, last_access=self.last_used(state))
            path = self._cache.match(state.token_ids, full * self._pool.block_size, touch=False, partition=partition)
        self._pool.decref(state.blocks)
        state.blocks = []
        state.num_cached = 0
        state.last_logits = None
        state.exact_len = None  # approximate K/V are gone: the next use rebuilds them densely (exact)
        self.spilled.add(state.id)
        self.handles_spilled += 1
        return path


