"""The KV manager: which pool blocks hold a state's K/V, and how they get there.

It owns block reservation (with copy-on-write), attaching a cached prefix from the radix cache,
loading evicted blocks back from the slow tiers (one path, for a request's miss and for prefetch
alike), offering finished blocks to the cache, dropping and trimming a state's blocks, and reading
or writing K/V rows of a state. A reservation short of blocks asks the one owner of kept KV
(:class:`~.store.KeptKV`: the prefix cache, retained approximate states, idle live handles, in one
priority order) once, then raises :class:`PoolExhausted`; it never waits (requests wait in the scheduler).

Released approximate states are kept KV too (:meth:`retain`): their K/V cannot enter the prefix cache, but
the same agent's next turn resumes from them (``reuse="auto"``), so a workflow that releases each result at
once (the README's pattern) keeps that resume (:mod:`.store` bounds and ranks them).

Invariants:

- a state owns one pool reference per block in ``state.blocks``; a block it will write is private
  (refcount 1) first: ``reserve`` copies a shared, partly filled block before anyone writes it;
- only exact K/V enter the prefix cache (``insert`` stops at ``state.exact_len``, and private
  measurement states never enter it);
- a state reads and feeds the prefix cache only within its own partition (``partition(state)``, by default
  the one partition ``""``; a multi-tenant server's: the state's tenant; None: it neither reads nor
  feeds the cache, as a state whose tenant is unknown there): see :mod:`.radix`;
- slow-tier I/O never runs under the engine lock: nodes are marked ``LOADING`` under the lock, read
  without it, installed under it again, and waiters on :attr:`loaded` are woken; a request that
  needs a loading block waits for it, the others run meanwhile.

Every method takes the engine lock itself (a re-entrant lock), except :meth:`attach` and
:meth:`load_back`, which must be called WITHOUT it, since they let it go during tier reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from kvbaton.errors import InvalidRequest, PoolExhausted
from kvbaton.handle import LineageStep, new_handle_id

from ..events import CacheEvents
from .block_pool import BlockPool
from .device_ops import BlockMover
from .eviction import EvictionPolicy, make_policy
from .radix import NodeState, RadixCache, RadixNode
from .sequence import KVState
from .spill import Spiller
from .store import KeptKV
from .tiers import TierSpec, make_tier

log = logging.getLogger(__name__)

# Blocks :meth:`KVManager.fill` holds in host memory and writes in one batched copy.
FILL_BATCH = 64


@dataclass
class TierCounters:
    """Where attached blocks came from, for ``Stats.cache``."""

    hits: dict[str, int] = field(default_factory=dict)  # blocks attached per tier ("device" included)
    loaded_on_demand: int = 0  # blocks a request's miss loaded back
    prefetched: int = 0  # blocks prefetch loaded back
    prefetch_hits: int = 0  # prefetched blocks a request then used


@dataclass
class Loads:
    """Where one request's attached blocks came from (its timeline event)."""

    blocks: dict[str, int] = field(default_factory=dict)  # "device" and each slow tier read back
    prefetch_hits: int = 0


class KVManager:
    def __init__(
        self, pool: BlockPool, cache: RadixCache | None, lock: threading.RLock,
        live: Callable[[], Iterable[KVState]] = tuple, partition: Callable[[KVState], str | None] = lambda state: "",
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.block_size = pool.block_size
        self.lock = lock  # the engine lock: guards the pool, the cache and the states' block lists
        self.loaded = threading.Condition(lock)  # signalled when slow-tier blocks arrive
        self.counters = TierCounters()
        # The prefix-cache partition of a state (one by default; a multi-tenant server's engine: the state's tenant).
        self.partition = partition
        self.spiller = Spiller(pool, cache, live, partition)  # ``live``: the engine's live states
        # The one owner of kept KV: the prefix cache, retained approximate states, idle handles (store.py).
        self.kept = KeptKV(pool, cache, self.spiller, on_freed=self._blocks_back)
        self.mover = cache.mover if cache is not None else BlockMover(pool)  # batched block copies (device_ops)
        self._pinned: Counter[int] = Counter()  # blocks read outside the lock (compose sources): never spilled
        self._last_back = time.monotonic()  # when blocks last came back (a waiting request's progress)

    # -- states --------------------------------------------------------------------------------
    def share(self, parent: KVState | None, keep: int, added: Sequence[int], step: LineageStep) -> KVState:
        """A new state sharing the K/V of ``parent``'s first ``keep`` tokens, followed by ``added``."""
        if parent is None:
            return KVState(id=new_handle_id(), token_ids=list(added), blocks=[], num_cached=0, lineage=(step,))
        with self.lock:
            self.spiller.touch(parent)
            cached = min(keep, parent.num_cached)
            logits = parent.last_logits if keep == parent.num_tokens and cached == keep and not added else None
            if not added and logits is None:
                cached = min(cached, keep - 1)  # the last token must run again to produce next-token logits
            blocks = parent.blocks[: self._blocks_for(cached)] if cached > 0 else []
            self.pool.incref(blocks)
        # Tokens computed behind approximate K/V are approximate too; behind an exact prefix they are exact.
        approximate = parent.exact_len is not None and keep > parent.exact_len
        return KVState(
            id=new_handle_id(),
            token_ids=parent.token_ids[:keep] + list(added),
            blocks=list(blocks),
            num_cached=cached,
            lineage=parent.lineage + (step,),
            last_logits=logits,
            exact_len=parent.exact_len if approximate else None,
            cacheable=parent.cacheable,
        )

    def check_fits(self, num_tokens: int) -> None:
        """Raise :class:`InvalidRequest` when ``num_tokens`` need more blocks than the whole pool has:
        no eviction or release could ever make room, so "retry later" (:class:`PoolExhausted`) would lie."""
        need = self._blocks_for(num_tokens)
        if need > self.pool.num_blocks:
            raise InvalidRequest(
                f"this request can never fit: its {num_tokens} tokens (prompt and max_tokens) need {need} KV blocks "
                f"of {self.block_size} tokens, the whole pool has {self.pool.num_blocks}; shorten the prompt or "
                "max_tokens, or raise kv_budget"
            )

    def reserve(self, state: KVState, num_tokens: int) -> None:
        """Make ``state`` own writable blocks for positions ``num_cached..num_tokens-1``, or raise:
        :class:`InvalidRequest` if it could never fit, :class:`PoolExhausted` if it does not fit now (after
        dropping retained states, evicting the prefix cache and spilling idle handles, in that order). It
        never waits: a request that does not fit waits in the scheduler's line instead."""
        with self.lock:
            self._reserve_now(state, num_tokens)

    @property
    def last_back(self) -> float:
        """When blocks last came back to the pool (``time.monotonic``): a waiting request's progress."""
        return self._last_back

    def _blocks_back(self) -> None:
        """Blocks came back (lock held)."""
        self._last_back = time.monotonic()

    def _reserve_now(self, state: KVState, num_tokens: int) -> None:
        bs = self.block_size
        self.check_fits(num_tokens)
        with self.lock:
            write_at = state.num_cached
            cow = write_at % bs != 0 and write_at < num_tokens and self.pool.refcount(state.blocks[write_at // bs]) > 1
            missing = max(0, self._blocks_for(num_tokens) - len(state.blocks))
            needed = missing + int(cow)
            if needed > self.pool.num_free:  # kept KV gives blocks back, in one order (store.py)
                self.kept.free(needed - self.pool.num_free, exclude=state, pinned=self._pinned)
            if needed > self.pool.num_free:
                raise PoolExhausted(
                    f"KV pool exhausted: the request needs {needed} more blocks of {bs} tokens, "
                    f"{self.pool.num_free} of {self.pool.num_blocks} are free; release handles or raise kv_budget"
                )
            if cow:
                shared = state.blocks[write_at // bs]
                (private,) = self.pool.allocate(1)
                self.pool.copy_block(shared, private, write_at % bs)
                self.pool.decref([shared])
                state.blocks[write_at // bs] = private
            if missing:
                state.blocks.extend(self.pool.allocate(missing))

    def trim(self, state: KVState) -> None:
        """Give back blocks reserved beyond the state's tokens (a generation that stopped early)."""
        with self.lock:
            keep = self._blocks_for(state.num_tokens)
            if len(state.blocks) > keep:
                self.pool.decref(state.blocks[keep:])
                del state.blocks[keep:]
                self._blocks_back()

    def release_blocks(self, state: KVState) -> None:
        """Give back every block of a request's state and keep its tokens, to be recomputed (preemption)."""
        self.drop(state)
        state.num_cached = 0
        state.stale.clear()

    def drop(self, state: KVState) -> None:
        """Give back every block of the state (idempotent)."""
        with self.lock:
            self.pool.decref(state.blocks)
            state.blocks = []
            state.last_logits = None
            self.spiller.forget(state)
            self._blocks_back()

    # -- released approximate states (kept KV: store.py) ------------------------------------------
    def retain(self, state: KVState) -> None:
        """Keep a released approximate state's blocks for its own next turn (:meth:`.store.KeptKV.retain`)."""
        with self.lock:
            self.kept.retain(state)

    def is_retained(self, state: KVState) -> bool:
        return self.kept.is_retained(state)

    def unretain(self, state: KVState) -> None:
        with self.lock:
            self.kept.unretain(state)

    def drop_retained(self) -> None:
        with self.lock:
            self.kept.drop_retained()

    @property
    def retained_blocks(self) -> int:
        with self.lock:
            return self.kept.retained_blocks

    def retained_only_blocks(self) -> int:
        with self.lock:
            return self.kept.retained_only_blocks()

    def pin(self, blocks: Sequence[int]) -> None:
        """Keep blocks readable while their owner may be released (compose sources, exports)."""
        with self.lock:
            self.pool.incref(blocks)
            self._pinned.update(blocks)

    def unpin(self, blocks: Sequence[int]) -> None:
        with self.lock:
            self.pool.decref(blocks)
            self._pinned.subtract(blocks)
            self._blocks_back()
            self._pinned += Counter()  # drops the zero counts

    def export(self, state: KVState) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the K/V of the state's computed blocks, one block at a time. The blocks are
        pinned now and until the iterator ends or is closed, so a concurrent release cannot
        recycle them mid-export."""
        with self.lock:
            blocks = list(state.blocks[: self._blocks_for(state.num_cached)])
            self.pool.incref(blocks)

        def read() -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
            try:
                for block in blocks:
                    yield self.pool.read_block(block)
            finally:
                self.unpin(blocks)

        return read()

    # -- K/V rows -----------------------------------------------------------------------------
    def read_rows(self, state: KVState, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.read_rows(self._readable(state, start, n))

    def _readable(self, state: KVState, start: int, n: int) -> torch.Tensor | slice:
        if state.id in self.spiller.spilled and start + n > state.num_cached:
            raise PoolExhausted(
                f"handle {state.id} was spilled to make room in the KV pool: the handles made from it (resume, "
                "extend, fork) get its K/V back, it does not keep them; read one of those, or release handles"
            )
        return self.pool.slots(state.blocks, start, start + n)

    def write_rows(self, state: KVState, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V rows at the state's next uncached positions (blocks reserved, privately owned)."""
        assert start == state.num_cached
        n = k.shape[2]
        self.pool.write_rows(self.pool.slots(state.blocks, start, start + n), k, v)
        state.num_cached = start + n
        state.last_logits = None

    def copy_rows(self, src: KVState, start: int, dst: KVState, offset: int, n: int,
                  keys: Callable[[torch.Tensor], torch.Tensor] = lambda k: k) -> None:
        """Rows ``start..`` of ``src`` become ``dst``'s next uncached positions ``offset..`` (blocks reserved,
        privately owned), the keys passed through ``keys`` (a RoPE shift), layer by layer in the pool."""
        assert offset == dst.num_cached
        self.pool.move_rows(self._readable(src, start, n), self.pool.slots(dst.blocks, offset, offset + n), keys)
        dst.num_cached = offset + n
        dst.last_logits = None

    def fill(self, state: KVState, blocks: Iterable[tuple[torch.Tensor, torch.Tensor]], num_cached: int) -> None:
        """Give a fresh state the K/V of its first ``num_cached`` tokens, whole blocks in order, as
        :meth:`export` yields them (from another engine of the same model), written ``FILL_BATCH`` blocks at a
        time (batched copies, a bounded number of blocks in host memory)."""
        self.reserve(state, num_cached)
        count = 0
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, v in blocks:
            if count >= len(state.blocks):
                raise InvalidRequest(f"more KV blocks than {num_cached} tokens need")
            pending.append((k, v))
            count += 1
            if len(pending) == FILL_BATCH:
                self.mover.to_device(state.blocks[count - len(pending) : count], pending)
                pending = []
        self.mover.to_device(state.blocks[count - len(pending) : count], pending)
        if count != len(state.blocks):
            raise InvalidRequest(f"got {count} KV blocks, {num_cached} tokens need {len(state.blocks)}")
        state.num_cached = num_cached

    # -- the prefix cache ---------------------------------------------------------------------
    def insert(self, state: KVState) -> None:
        """Offer the state's full blocks to the prefix cache: only those whose K/V are exact."""
        with self.lock:
            self.spiller.touch(state)  # just computed: the last candidate to spill
        partition = self.partition(state)
        if self.cache is not None and state.cacheable and partition is not None:
            exact = state.num_cached if state.exact_len is None else min(state.num_cached, state.exact_len)
            with self.lock:
                self.cache.insert(state.token_ids, state.blocks, exact // self.block_size, partition)

    def full_block(self, state: KVState, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A copy of the K/V of the state's ``i``-th full block: its own, else the prefix cache's (on
        the device or in a slow tier); None when neither holds it (a spilled handle's dropped block)."""
        with self.lock:
            if (i + 1) * self.block_size <= state.num_cached:
                return self.pool.read_block(state.blocks[i])
            partition = self.partition(state)
            if self.cache is None or partition is None:
                return None
            path = self.cache.match(state.token_ids, (i + 1) * self.block_size, touch=False, partition=partition)
            if len(path) <= i:
                return None
            node = path[i]
            if node.state is NodeState.DEVICE and node.block is not None:
                return self.pool.read_block(node.block)
            if node.state is not NodeState.SLOW:
                return None
            try:
                return self.cache.read(node)
            except Exception as exc:  # noqa: BLE001 - a failing tier: that block is recomputed later
                log.warning("%s; that block will be recomputed", exc)
                return None

    def cache_blocks(
        self, tokens: Sequence[int], n: int, read: Callable[[int], tuple[torch.Tensor, torch.Tensor] | None],
        partition: str | None = "",
    ) -> int:
        """Put the first ``n`` full blocks of ``tokens`` in the prefix cache's ``partition``, block ``i``'s K/V from
        ``read(i)``, while the pool has free blocks and ``read`` has data (None: stop, the rest is
        recomputed when needed); blocks the cache holds already are kept. How many were read."""
        if self.cache is None or n <= 0 or partition is None:
            return 0
        with self.lock:
            have = len(self.cache.match(tokens, n * self.block_size, touch=False, partition=partition))
            data = []
            for i in range(have, min(n, have + self.pool.num_free)):
                kv = read(i)
                if kv is None:
                    break
                data.append(kv)
            blocks = self.pool.allocate(len(data))
            self.mover.to_device(blocks, data)  # one batched copy
            if not blocks:
                return 0
            # The path's existing nodes, then the new blocks: the cache takes its own references.
            path = self.cache.match(tokens, have * self.block_size, touch=False, partition=partition)
            full = [nd.block for nd in path] + blocks
            if any(b is None for b in full):
                self.pool.decref(blocks)  # an ancestor is not on the device: the tree cannot take these
                return 0
            self.cache.insert(tokens, full, len(full), partition)  # type: ignore[arg-type]
            self.pool.decref(blocks)
            return len(blocks)

    def held_by_cache(self, state: KVState) -> list[int]:
        """The device blocks in which the prefix cache holds the leading full blocks of ``state``'s exact
        tokens (in its partition): what of a released state's K/V stays readable until the cache lets it go."""
        partition = self.partition(state)
        if self.cache is None or partition is None or not state.cacheable:
            return []
        exact = state.num_cached if state.exact_len is None else min(state.num_cached, state.exact_len)
        with self.lock:
            path = self.cache.match(state.token_ids, exact - exact % self.block_size, touch=False, partition=partition)
            return [n.block for n in _on_device(path)]  # type: ignore[misc]

    def cached_prefix(self, tokens: Sequence[int], partition: str | None = "") -> int:
        """How many leading ``tokens`` the prefix cache's ``partition`` holds on the device (what a prefill skips)."""
        if self.cache is None or partition is None:
            return 0
        with self.lock:
            path = self.cache.match(list(tokens), len(tokens) - 1, touch=False, partition=partition)
            return len(_on_device(path)) * self.block_size

    def attach(self, state: KVState, loads: Loads | None = None) -> None:
        """Take the longest cached prefix of the state's tokens from the radix cache (call WITHOUT the lock).

        Blocks in a slow tier are loaded back first; blocks another request or prefetch is loading
        are waited for. A block that cannot be read back is forgotten and its tokens recomputed.
        """
        cache, partition = self.cache, self.partition(state)
        if cache is None or partition is None or not state.cacheable or state.num_tokens - 1 <= state.num_cached:
            return
        stuck = False  # the last load-back could begin nothing (no room): take what is on the device
        while True:
            with self.lock:
                path = cache.match(state.token_ids, state.num_tokens - 1, partition=partition)
                if len(path) * self.block_size <= state.num_cached:
                    return
                if any(n.state is NodeState.LOADING for n in path):  # another request or prefetch loads it
                    self.loaded.wait(timeout=1.0)
                    continue
                if stuck or not any(n.state is NodeState.SLOW for n in path):
                    self._take(state, path, loads)
                    return
                self._room_to_load(state, path)
            stuck = self.load_back(path, loaded=None if loads is None else loads.blocks) == 0

    def load_back(
        self, path: Sequence[RadixNode], allowed: Callable[[RadixNode], bool] | None = None, *, prefetch: bool = False,
        loaded: dict[str, int] | None = None,
    ) -> int:
        """Bring the slow nodes of ``path`` back to the device (call WITHOUT the lock); how many it began
        (``loaded``, when given, counts the blocks read back per tier).

        ``allowed`` limits what making room may evict (prefetch evicts only what is needed later).
        Every node begun is finished, with its data or as a failure, so nobody waits on it forever.
        """
        cache = self.cache
        assert cache is not None
        with self.lock:
            started = cache.begin_load(path, allowed=allowed)
            tiers = {id(n): cache.tiers[n.tier].name for n in started}  # type: ignore[index]
        data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        try:
            for node in started:  # the slow part, outside the lock
                try:
                    data[id(node)] = cache.read(node)
                except Exception as exc:  # any tier failure: those tokens are recomputed, the request goes on
                    log.warning("%s; those tokens will be recomputed", exc)
        finally:
            with self.lock:
                # root to leaf, one batched copy into the pool: a failed node drops the rest with it
                for node in cache.finish_loads(started, [data.get(id(n)) for n in started]):
                    tier = tiers[id(node)]
                    if loaded is not None:
                        loaded[tier] = loaded.get(tier, 0) + 1
                    if prefetch:
                        node.prefetched = True
                        self.counters.prefetched += 1
                    else:
                        self.counters.hits[tier] = self.counters.hits.get(tier, 0) + 1
                        self.counters.loaded_on_demand += 1
                self.loaded.notify_all()
        return len(started)

    def _room_to_load(self, state: KVState, path: Sequence[RadixNode]) -> None:
        """Spill idle handles so that a request's slow blocks can come back (lock held). Prefetch
        never does this: it only evicts cache nodes needed later than what it loads."""
        slow = sum(n.state is NodeState.SLOW for n in path)
        if slow > self.pool.num_free:
            keep = {id(n) for n in path}
            self.kept.free(slow - self.pool.num_free, exclude=state, pinned=self._pinned,
                           allowed=lambda node: id(node) not in keep)

    def slow_fixed_path(self, agent: str) -> list[RadixNode]:
        """The cache path of an agent's fixed prompt when part of it is in a slow tier, else []."""
        if self.cache is None:
            return []
        with self.lock:
            path = self.cache.fixed_path(agent)
            return path if any(n.state is NodeState.SLOW for n in path) else []

    def _take(self, state: KVState, path: Sequence[RadixNode], loads: Loads | None = None) -> None:
        """Swap the state's leading blocks for the cached ones of ``path`` when that covers more (lock held)."""
        device = _on_device(path)
        if len(device) * self.block_size <= state.num_cached:
            return
        hits = 0
        for node in device:
            if node.prefetched:
                node.prefetched = False
                hits += 1
        self.counters.prefetch_hits += hits
        self.counters.hits["device"] = self.counters.hits.get("device", 0) + len(device)
        if loads is not None:
            loads.prefetch_hits += hits
            # Blocks read back for this request were counted per tier by load_back; the rest were on the device.
            loads.blocks["device"] = max(0, len(device) - sum(v for k, v in loads.blocks.items() if k != "device"))
        blocks = [n.block for n in device]
        self.pool.incref(blocks)  # type: ignore[arg-type]
        self.pool.decref(state.blocks)
        state.blocks = blocks  # type: ignore[assignment]
        state.num_cached = len(blocks) * self.block_size
        state.last_logits = None

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def prefix_cache_for(
    pool: BlockPool, ste: Mapping[str, float], eviction: str | EvictionPolicy = "ste", tiers: Sequence[TierSpec] = (),
    tier_eviction: str | None = None, events: CacheEvents | None = None,
) -> RadixCache:
    """The radix cache over ``pool``, its eviction policies reading the live steps-to-execution ``ste``,
    with the slow ``tiers`` (claimed by :func:`.tiers.claim_tiers`) behind it, telling ``events`` of its
    eviction rounds."""
    policy = eviction if isinstance(eviction, EvictionPolicy) else make_policy(eviction, ste)
    slow = [make_tier(t, pool.shape.bytes_per_block, pool.device) for t in tiers]
    tier_policy = make_policy(tier_eviction, ste) if tier_eviction else None
    return RadixCache(pool, policy, slow, tier_policy, events)


def _on_device(path: Sequence[RadixNode]) -> list[RadixNode]:
    """The leading nodes of ``path`` whose blocks are in the pool."""
    device = []
    for node in path:
        if node.state is not NodeState.DEVICE:
            break
        device.append(node)
    return device
