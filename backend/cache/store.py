"""The one owner of kept KV: every kind of K/V the engine holds without a running request, given back in one
order when a request needs blocks (the role of SGLang's ``BasePrefixCache``: match, insert, evict, reserve).

The kinds, each seen by the eviction policy (:mod:`.eviction`) as a node with owners and a last use on one
clock, so that one priority order — steps-to-execution first, then recency — ranks them all:

- **prefix blocks** (:mod:`.radix`): exact K/V by token prefix, shared by every request that starts with
  them; a cached block's owners are the agents whose fixed prompt spells it. Evicted to the first slow tier
  (or dropped) one leaf at a time. Released handles' spans live on as views of these blocks (the span
  index's ``cached`` sources) and end when the cache lets them go;
- **retained approximate states**: released turns whose K/V were approximated (they cannot enter the prefix
  cache) kept for their agent's next turn (:meth:`retain`), at most :data:`MAX_RETAINED`. One possible use:
  ranked as the oldest of the unowned, so an unhinted one goes before any cache block; its agent's
  steps-to-execution keep it when that agent runs soon;
- **idle live handles** (:mod:`.spill`): handles nothing is using — an SDK caller's, an adapter's, a server's
  agent slot — ranked by their agent and last use; taking their blocks *spills* them (exact blocks into the
  prefix cache, the handle rebuilt from its lineage on next use), never loses them.

:meth:`KeptKV.free` is the one way blocks come back under pressure: the reservation of a request
(:meth:`.kv_manager.KVManager.reserve`) asks it once. It frees nothing unless what it could free suffices,
so a reservation that fails takes nothing from anyone. Anchor pools of the correction hold no pool blocks
(their own bound, :mod:`..reuse.correction`), and requests in flight are the scheduler's, not kept KV.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from .block_pool import BlockPool
from .eviction import LRU, EvictionPolicy
from .radix import RadixCache, RadixNode
from .sequence import KVState
from .spill import Spiller

MAX_RETAINED = 64  # released approximate states kept for their own next turn
_CACHE, _RETAINED, _IDLE = 0, 1, 2


@dataclass
class _AsNode:
    """A retained state or an idle handle as the eviction policy sees a cache node."""

    last_access: int
    owners: set[str] = field(default_factory=set)


class KeptKV:
    def __init__(self, pool: BlockPool, cache: RadixCache | None, spiller: Spiller,
                 on_freed: Callable[[], None] = lambda: None) -> None:
        self._pool = pool
        self.cache = cache
        self.spiller = spiller
        self.policy: EvictionPolicy = cache.policy if cache is not None else LRU()
        self._on_freed = on_freed  # blocks came back (a waiting request's progress)
        self._retained: OrderedDict[str, KVState] = OrderedDict()  # oldest first

    # -- retained approximate states ------------------------------------------------------------
    def retain(self, state: KVState) -> None:
        """Keep a released approximate state's blocks, as a cache: until its own next turn takes it
        (:meth:`unretain`), :data:`MAX_RETAINED` newer ones push it out, or a reservation needs its blocks."""
        self.spiller.forget(state)
        self._retained[state.id] = state
        while len(self._retained) > MAX_RETAINED:
            self._release_retained(next(iter(self._retained)))

    def is_retained(self, state: KVState) -> bool:
        return self._retained.get(state.id) is state

    def unretain(self, state: KVState) -> None:
        """Stop keeping ``state`` (taken by its next turn, which holds its own references now)."""
        if self.is_retained(state):
            self._release_retained(state.id)

    def drop_retained(self) -> None:
        for state_id in list(self._retained):
            self._release_retained(state_id)

    @property
    def retained_blocks(self) -> int:
        return sum(len(state.blocks) for state in self._retained.values())

    def retained_only_blocks(self) -> int:
        """Blocks nothing but retained states (and the prefix cache) references."""
        refs = Counter(b for state in self._retained.values() for b in state.blocks)
        cached = self.cache.cached_blocks() if self.cache is not None else set()
        return sum(1 for b, n in refs.items() if self._pool.refcount(b) == n + (b in cached))

    def _release_retained(self, state_id: str) -> None:
        state = self._retained.pop(state_id)
        self.spiller.forget(state)
        self._pool.decref(state.blocks)
        state.blocks = []
        state.num_cached = 0
        state.last_logits = None
        self._on_freed()

    # -- giving blocks back --------------------------------------------------------------------
    def free(self, n: int, *, exclude: KVState | None = None, pinned: Collection[int] = (),
             allowed: Callable[[RadixNode], bool] | None = None) -> int:
        """Free ``n`` pool blocks from kept KV, lowest priority first across every kind (lock held); how many
        came back. Nothing is taken unless taking everything that can be taken would free ``n``. ``exclude``:
        the state reserving; ``allowed``: the cache nodes that may go (a load-back keeps the path it loads)."""
        start = self._pool.num_free
        if n <= 0 or self._freeable(exclude, pinned) < n:
            return 0
        for _ in range(3):  # spilled handles' and released states' blocks become cache leaves: look again
            progressed = self._free_round(start + n, exclude, pinned, allowed)
            if self._pool.num_free >= start + n or not progressed:
                break
        freed = self._pool.num_free - start
        if freed:
            self._on_freed()
        return freed

    def _free_round(self, target: int, exclude: KVState | None, pinned: Collection[int],
                    allowed: Callable[[RadixNode], bool] | None) -> bool:
        heap: list[tuple[Any, int, int, Any]] = []
        order = itertools.count()
        policy = self.policy

        def push(key: Any, kind: int, item: Any) -> None:
            heapq.heappush(heap, (key, next(order), kind, item))

        cache = self.cache
        if cache is not None:
            for node in cache.evictable_leaves(allowed):
                push(policy.priority(node), _CACHE, node)
        for state in self._retained.values():
            push(policy.priority(self._retained_view(state)), _RETAINED, state)
        for state in self.spiller.candidates(pinned, exclude):
            push(policy.priority(_AsNode(self.spiller.last_used(state), _owners(state))), _IDLE, state)
        victims: list[RadixNode] = []
        progressed = False
        while heap and self._pool.num_free + len(victims) < target:
            _, _, kind, item = heapq.heappop(heap)
            if kind == _CACHE:
                assert cache is not None
                if not cache.evictable(item):
                    continue
                cache.mark_offloading(item)
                victims.append(item)
                parent = item.parent
                if parent is not None and parent.parent is not None and cache.evictable(parent) \
                        and (allowed is None or allowed(parent)):  # not a root
                    push(policy.priority(parent), _CACHE, parent)
            elif kind == _RETAINED:
                if self.is_retained(item):
                    self._release_retained(item.id)
                    progressed = True
            else:
                path = self.spiller.spill(item)
                if path is None:
                    continue
                progressed = True
                if path and cache is not None and cache.evictable(path[-1]):  # its blocks go in its turn
                    push(policy.priority(path[-1]), _CACHE, path[-1])
        if victims:
            assert cache is not None
            cache.offload(victims)
            progressed = True
        return progressed

    def _retained_view(self, state: KVState) -> _AsNode:
        """A retained state serves one possible next turn: the oldest of all (last use -1), and owned (kept by
        the steps-to-execution order) only when its agent's hint says it runs."""
        ste = getattr(self.policy, "node_ste", None)
        owners = _owners(state)
        if ste is not None and math.isinf(ste(_AsNode(-1, owners))):
            owners = set()
        return _AsNode(-1, owners)

    def _freeable(self, exclude: KVState | None, pinned: Collection[int]) -> int:
        """Blocks that taking everything would free: those only kept KV (and free space) holds."""
        holders = [*self._retained.values(), *self.spiller.candidates(pinned, exclude)]
        refs = Counter(b for s in holders for b in s.blocks)
        cached = self.cache.cached_blocks() if self.cache is not None else set()
        from_holders = sum(1 for b, r in refs.items() if self._pool.refcount(b) - (b in cached) == r)
        cache_only = sum(1 for b in cached if b not in refs and self._pool.refcount(b) == 1)
        return from_holders + cache_only


def _owners(state: KVState) -> set[str]:
    return {state.agent} if state.agent else set()
