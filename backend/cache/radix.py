"""Radix prefix cache over block-aligned token prefixes, with slow tiers behind the device pool.

Each node stands for one full KV block: its key is that block's ``block_size`` token ids, and
the path from the root spells the whole prefix the block's K/V depend on. The tree holds one
reference on the pool block of every on-device node; handles and running requests hold their own
references, so a block is evictable only when the tree's is the last one.

Node states: ``device`` (in the pool), ``offloading`` (chosen for eviction, being written to a slow
tier; within one ``evict`` call, so transient), ``slow`` (only in a slow tier), ``loading`` (pool block reserved, data on its
way back). A tier that fails (a full disk, its directory removed, an unreadable block) never fails
the request that made room: the block is dropped instead, as if no tier had room (its tokens are
recomputed when next needed), and the failure is counted in ``tier_errors``. A write that finds the
volume full (``ENOSPC``) first gives back the tier's own lowest-priority blocks, one at a time, and
retries: the tier is a cache, so its files are what goes first on a full volume
(:meth:`RadixCache.shrink_tier` does the same for the volume's other writers). Invariant: the
ancestors of an on-device node are on the device too, because eviction takes device leaves first
and loading goes root to leaf. A node removed from the tree is
``dropped``, so code still holding an old path can tell. Every walk of the tree is iterative: a chain
is as deep as a prompt has blocks, far deeper than Python's recursion limit.

The tree has one root per *partition* (a multi-tenant server's tenant; ``""`` by default): a prefix is
matched and inserted within one partition only, so one partition never reuses, waits on or loads back
another's blocks (nor learns from its timing what another sent). The pool, the tiers, eviction and
flush are shared by every partition.

Which candidate goes first is the eviction policy's business (``eviction.py``); the tree only
knows which nodes may go.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..events import CacheEvents
from .block_pool import BlockPool
from .blockfile import BlockDataError
from .device_ops import BlockMover
from .eviction import EvictionPolicy
from .tiers import Tier

log = logging.getLogger(__name__)

# Registered agents one cache keeps (their fixed prompts' token ids, up to the model's context each, on
# the host): beyond, the least recently registered is forgotten. The server bounds each tenant further.
MAX_AGENTS = 4096


class NodeState(str, Enum):
    DEVICE = "device"
    OFFLOADING = "offloading"
    SLOW = "slow"
    LOADING = "loading"
    DROPPED = "dropped"  # no longer in the tree; holders of a stale path see this


@dataclass(eq=False)
class RadixNode:
    id: int
    key: tuple[int, ...]
    parent: RadixNode | None = field(repr=False)  # not in the repr: it would spell the whole chain, recursively
    depth: int  # blocks from the root; the node covers tokens (depth-1)*bs .. depth*bs-1
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict, repr=False)
    block: int | None = None
    state: NodeState = NodeState.DEVICE
    tier: int | None = None
    owners: set[str] = field(default_factory=set)
    last_access: int = 0
    prefetched: bool = False  # brought back by prefetch and not used since


class RadixCache:
    def __init__(
        self,
        pool: BlockPool,
        policy: EvictionPolicy,
        tiers: Sequence[Tier] = (),
        tier_policy: EvictionPolicy | None = None,
        events: CacheEvents | None = None,
        mover: BlockMover | None = None,
    ) -> None:
        self.pool = pool
        # Batched block copies to and from the tiers, straight into the host tier's slab when it is the first.
        self.mover = mover or BlockMover(pool, host=tiers[0] if tiers else None)
        self.policy = policy
        self.tier_policy = tier_policy or policy  # order inside the slow tiers (the same unless ablating)
        self.tiers = list(tiers)
        self.bs = pool.block_size
        # One root per partition; partition "" is the one partition by default.
        self._roots: dict[str, RadixNode] = {"": RadixNode(id=0, key=(), parent=None, depth=0)}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        # name -> (partition, fixed tokens), least recently registered first; at most MAX_AGENTS
        self._agents: dict[str, tuple[str, array[int]]] = {}
        self._in_tier: list[set[RadixNode]] = [set() for _ in self.tiers]
        self.device_nodes = 0
        self.bytes_offloaded = 0
        self.nodes_dropped = 0
        self.tier_errors = 0
        # Told of each eviction round (where its blocks went: a tier's name or "dropped") and of every device
        # block the tree lets go (the span index's views of cached blocks stop reading it).
        self._events = events

    # -- agents -------------------------------------------------------------------------------
    def register_agent(self, name: str, fixed_tokens: Sequence[int], partition: str = "") -> None:
        """Tag the nodes of ``name``'s fixed prompt in ``partition`` (now and as they are inserted later).
        Beyond ``MAX_AGENTS`` registrations the least recently registered one is forgotten (a caching
        hint, as the cache itself: its agent's requests run as before)."""
        self.unregister_agent(name)
        self._agents[name] = (partition, array("i", fixed_tokens))  # 4 bytes a token, not a list of ints' 36
        while len(self._agents) > MAX_AGENTS:
            self.unregister_agent(next(iter(self._agents)))
        node = self._root(partition)
        for key in self._keys(fixed_tokens, len(fixed_tokens) // self.bs):
            node = node.children.get(key)  # type: ignore[assignment]
            if node is None:
                break
            node.owners.add(name)

    def unregister_agent(self, name: str) -> bool:
        """Forget ``name``'s fixed prompt and untag its nodes; whether it was registered."""
        for node in self._walk_all():
            node.owners.discard(name)
        return self._agents.pop(name, None) is not None

    def fixed_path(self, name: str) -> list[RadixNode]:
        """The nodes of ``name``'s fixed prompt, in the partition it was registered in."""
        partition, tokens = self._agents.get(name, ("", array("i")))
        return self.match(tokens, len(tokens), touch=False, partition=partition)

    # -- lookup and insertion -------------------------------------------------------------------
    def match(
        self, tokens: Sequence[int], max_tokens: int, touch: bool = True, partition: str = ""
    ) -> list[RadixNode]:
        """Nodes (any state) spelling the longest block-aligned prefix of ``tokens[:max_tokens]`` cached in ``partition``."""
        path: list[RadixNode] = []
        node = self._roots.get(partition)
        if node is None:
            return path
        now = next(self._clock) if touch else 0
        for key in self._keys(tokens, max_tokens // self.bs):
            child = node.children.get(key)
            if child is None:
                break
            if touch:
                child.last_access = now
            path.append(child)
            node = child
        return path

    def tick(self) -> int:
        """A time on the cache's clock (what ``last_access`` counts): later calls give larger values."""
        return next(self._clock)

    def insert(self, tokens: Sequence[int], blocks: list[int], num_full: int, partition: str = "",
               last_access: int | None = None) -> None:
        """Cache the first ``num_full`` blocks of a sequence whose K/V are in ``blocks``, in ``partition``.

        Where the tree already holds a block for the same prefix, the sequence switches to the
        tree's copy (``blocks`` is updated in place, references moved), so identical prefixes are
        stored once (per partition). A node waiting in a slow tier is revived from the sequence's block for free.
        """
        if num_full <= 0:
            return
        node = self._root(partition)
        now = next(self._clock) if last_access is None else last_access  # a spilled handle's: its last use
        for i, key in enumerate(self._keys(tokens, num_full)):
            child = node.children.get(key)
            if child is None:
                child = RadixNode(id=next(self._ids), key=key, parent=node, depth=node.depth + 1, block=blocks[i])
                child.owners = self._owners_for(node, key, child.depth, partition)
                node.children[key] = child
                self.pool.incref([blocks[i]])
                self.device_nodes += 1
            elif child.state is NodeState.DEVICE:
                if child.block != blocks[i]:
                    self.pool.incref([child.block])  # type: ignore[list-item]
                    self.pool.decref([blocks[i]])
                    blocks[i] = child.block  # type: ignore[assignment]
            elif child.state is NodeState.SLOW:
                self._forget_tier_copy(child)
                child.block, child.state = blocks[i], NodeState.DEVICE
                self.pool.incref([blocks[i]])
                self.device_nodes += 1
            # LOADING: the loader will fill it; the sequence keeps its own block meanwhile.
            child.last_access = max(child.last_access, now)
            node = child

    # -- eviction -------------------------------------------------------------------------------
    def evictable(self, node: RadixNode) -> bool:
        return (
            node.state is NodeState.DEVICE
            and node.block is not None
            and self.pool.refcount(node.block) == 1
            and not any(c.state in (NodeState.DEVICE, NodeState.LOADING) for c in node.children.values())
        )

    def evictable_leaves(self, allowed: Callable[[RadixNode], bool] | None = None) -> list[RadixNode]:
        return [node for node in self._walk_all() if self.evictable(node) and (allowed is None or allowed(node))]

    def mark_offloading(self, node: RadixNode) -> None:
        """Choose an evictable node as a victim (its parent may become a leaf); :meth:`offload` finishes it."""
        node.state = NodeState.OFFLOADING

    def evict(self, n: int, allowed: Callable[[RadixNode], bool] | None = None) -> int:
        """Free up to ``n`` pool blocks, offloading to the first slow tier when there is one.

        The victims are chosen first (each marked offloading, so its parent can become a leaf), then their
        blocks are read in one batched copy (:class:`~.device_ops.BlockMover`) and stored in order."""
        heap = [(self.policy.priority(node), node.id, node) for node in self.evictable_leaves(allowed)]
        heapq.heapify(heap)
        evicted: list[RadixNode] = []
        while heap and len(evicted) < n:
            _, _, node = heapq.heappop(heap)
            if not self.evictable(node):
                continue
            parent = node.parent
            self.mark_offloading(node)
            evicted.append(node)
            if parent is not None and parent.parent is not None and self.evictable(parent):  # not a root
                if allowed is None or allowed(parent):
                    heapq.heappush(heap, (self.policy.priority(parent), parent.id, parent))
        return self.offload(evicted)

    def offload(self, evicted: list[RadixNode]) -> int:
        """Finish evicting nodes marked offloading: their blocks read in one batched copy and stored in the first
        tier in order (dropped without one), the blocks given back; how many."""
        blocks = [node.block for node in evicted]
        data = self.mover.to_host(blocks) if self.tiers else [None] * len(evicted)  # type: ignore[arg-type]
        for node, block, kv in zip(evicted, blocks, data):
            self._evict_one(node, block, kv)  # type: ignore[arg-type]
        if evicted and self._events is not None:
            owners = {agent for node in evicted for agent in node.owners}
            tier = self.tiers[0].name if self.tiers else "dropped"
            self._events.evicted(owners, len(evicted), tier, self.policy.name)
        return len(evicted)

    def _evict_one(self, node: RadixNode, block: int, data: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Store an offloading node's ``data`` (its block's K/V) in the first tier, or drop it without tiers;
        give its block back either way."""
        if node.state is NodeState.DROPPED:  # a store before it dropped it (and the block is still ours)
            pass
        elif data is not None:
            k, v = data
            if self._store(0, node, k, v):
                self.bytes_offloaded += k.nbytes + v.nbytes
        else:
            self._detach(node)
        self._let_go([block])
        node.block = None
        self.device_nodes -= 1

    def _store(self, index: int, node: RadixNode, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Put a node's data in tier ``index``; if no room can be made, drop the node instead."""
        tier = self.tiers[index]
        while True:
            while tier.full:
                if not self._make_room(index, exclude=node):
                    self._drop_subtree(node)
                    return False
            try:
                tier.put(node.id, k, v)
                break
            except OSError as exc:
                # A full volume (shared, so the tier's free-space check can be overtaken): the tier's own
                # blocks are a cache, give one back and retry; with none left, the block is dropped.
                if exc.errno == errno.ENOSPC and self._make_room(index, exclude=node):
                    continue
                failed: Exception = exc
            except Exception as exc:  # noqa: BLE001 - a removed directory, any tier error: same as a full disk
                failed = exc
            self.tier_failed(tier, "write", failed)  # drop the block, never fail the request
            self._drop_subtree(node)
            return False
        node.state, node.tier = NodeState.SLOW, index
        self._in_tier[index].add(node)
        return True

    def shrink_tier(self, index: int, n: int) -> int:
        """Give back up to ``n`` blocks of tier ``index`` (lowest priority first, moved one tier down or
        dropped from the last): its space is wanted by something that is not a cache. How many went."""
        done = 0
        while done < n and self._make_room(index, exclude=None):
            done += 1
        return done

    def _make_room(self, index: int, exclude: RadixNode | None) -> bool:
        """Move the lowest-priority block of tier ``index`` one tier down, or drop it from the last."""
        keep = _path_to(exclude) if exclude is not None else set()  # dropping one would drop ``exclude``
        candidates = [nd for nd in self._in_tier[index] if nd not in keep]
        if not candidates:
            return False
        victim = min(candidates, key=lambda nd: (bool(nd.children), self.tier_policy.priority(nd), nd.id))
        if index + 1 < len(self.tiers):
            try:
                k, v = self.tiers[index].get(victim.id)
            except Exception as exc:
                self.tier_failed(self.tiers[index], "read", exc)
                self._drop_subtree(victim)
                return True  # room made all the same
            self._forget_tier_copy(victim)
            self._store(index + 1, victim, k, v)
        else:
            self._drop_subtree(victim)
        return True

    # -- loading back ---------------------------------------------------------------------------
    def begin_load(self, nodes: Sequence[RadixNode], allowed: Callable[[RadixNode], bool] | None = None) -> list[RadixNode]:
        """Reserve pool blocks for slow nodes (root to leaf) and mark them loading.

        Stops at the first node it cannot place without evicting something ``allowed`` forbids.
        """
        started = []
        protected = {id(n) for n in nodes}

        def may_go(other: RadixNode) -> bool:
            return id(other) not in protected and (allowed is None or allowed(other))

        for i, node in enumerate(nodes):
            if node.state is NodeState.DROPPED:
                break  # making room dropped it (and so everything below it): the rest is gone
            if node.state is not NodeState.SLOW:
                continue
            if self.pool.num_free == 0:
                # Room for every slow node left in one eviction (one tree walk, one batched copy), not one
                # block at a time: per block, a walk of the whole tree and a device sync each (issue 38).
                need = sum(n.state is NodeState.SLOW for n in nodes[i:])
                self.evict(need, may_go)  # may make room in a tier by dropping this very node
            if self.pool.num_free == 0 or node.state is not NodeState.SLOW:
                break
            (node.block,) = self.pool.allocate(1)
            node.state = NodeState.LOADING
            self._in_tier[node.tier].discard(node)  # type: ignore[index]  # not a tier victim while loading
            self.device_nodes += 1
            started.append(node)
        return started

    def read(self, node: RadixNode) -> tuple[torch.Tensor, torch.Tensor]:
        """Fetch a loading node's data from its tier (no lock needed; may raise BlockDataError)."""
        tier = node.tier
        if tier is None:
            raise BlockDataError(f"node {node.id} is no longer in a slow tier")
        return self.tiers[tier].get(node.id)

    def finish_load(self, node: RadixNode, data: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        """Install loaded data, or on failure forget the node (its tokens will be recomputed)."""
        return bool(self.finish_loads([node], [data]))

    def finish_loads(self, nodes: Sequence[RadixNode],
                     data: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> list[RadixNode]:
        """Install the data of loading ``nodes`` (root to leaf) in one batched copy; a node whose data is None
        (its tier could not read it back) is forgotten with everything below it. The nodes installed."""
        installed: list[RadixNode] = []
        for node, kv in zip(nodes, data):
            if node.state is not NodeState.LOADING:
                continue  # dropped meanwhile (a failed ancestor, a flush): its block is gone with it
            if kv is None:  # the reader could not read it back (and logged why)
                self.tier_errors += 1
                self._drop_subtree(node)
                continue
            installed.append(node)
        by_node = {id(node): kv for node, kv in zip(nodes, data)}
        self.mover.to_device([n.block for n in installed], [by_node[id(n)] for n in installed])  # type: ignore[misc]
        for node in installed:
            self._forget_tier_copy(node)
            node.state = NodeState.DEVICE
        return installed

    def tier_failed(self, tier: Tier, what: str, exc: BaseException) -> None:
        """Count a tier failure; log the 1st, 2nd, 4th, 8th... so a full disk cannot flood the log."""
        self.tier_errors += 1
        if self.tier_errors & (self.tier_errors - 1) == 0:
            log.warning("%s tier %s failed (%s); the block is dropped and its tokens recomputed when needed "
                        "[%d tier errors so far]", tier.name, what, exc, self.tier_errors)

    # -- bookkeeping ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every cached prefix that nothing else references (all tiers, every partition)."""
        for root in self._roots.values():
            for child in list(root.children.values()):
                self._drop_subtree(child)

    def close(self) -> None:
        self.flush()
        for tier in self.tiers:
            tier.close()

    def cached_blocks(self) -> set[int]:
        return {n.block for n in self._walk_all() if n.state is NodeState.DEVICE and n.block is not None}

    def nodes_in_tier(self, index: int) -> int:
        return len(self._in_tier[index])

    def _drop_subtree(self, node: RadixNode) -> None:
        """Drop ``node`` and everything below it, leaves first (iteratively: a long prompt's chain of
        blocks is deeper than Python's recursion limit)."""
        order = [node]
        stack = [node]
        while stack:
            children = stack.pop().children.values()
            order.extend(children)
            stack.extend(children)
        for dropped in reversed(order):  # every node after its parent in ``order``: children go first
            if dropped.state in (NodeState.DEVICE, NodeState.LOADING) and dropped.block is not None:
                self._let_go([dropped.block])
                self.device_nodes -= 1
            dropped.block = None
            self._forget_tier_copy(dropped)
            self._detach(dropped)
            self.nodes_dropped += 1

    def _let_go(self, blocks: list[int]) -> None:
        """Give up the tree's reference on device blocks, telling whoever reads them as the cache's first."""
        if self._events is not None:
            self._events.dropped(blocks)
        self.pool.decref(blocks)

    def _detach(self, node: RadixNode) -> None:
        if node.parent is not None:
            node.parent.children.pop(node.key, None)
        node.state = NodeState.DROPPED
        node.tier = None

    def _forget_tier_copy(self, node: RadixNode) -> None:
        """Delete the node's slow-tier copy, if any."""
        if node.tier is not None:
            try:
                self.tiers[node.tier].delete(node.id)
            except Exception as exc:  # forgotten all the same: the tier's close removes what is left
                self.tier_failed(self.tiers[node.tier], "delete", exc)
            self._in_tier[node.tier].discard(node)
            node.tier = None

    def _owners_for(self, parent: RadixNode, key: tuple[int, ...], depth: int, partition: str) -> set[str]:
        owners = set()
        for name, (agent_partition, fixed) in self._agents.items():
            if agent_partition != partition:
                continue
            if (parent.parent is None or name in parent.owners) and depth * self.bs <= len(fixed):
                if tuple(fixed[(depth - 1) * self.bs : depth * self.bs]) == key:
                    owners.add(name)
        return owners

    def _keys(self, tokens: Sequence[int], num_blocks: int):  # type: ignore[no-untyped-def]
        bs = self.bs
        for i in range(num_blocks):
            yield tuple(tokens[i * bs : (i + 1) * bs])

    def _root(self, partition: str) -> RadixNode:
        root = self._roots.get(partition)
        if root is None:
            root = self._roots[partition] = RadixNode(id=next(self._ids), key=(), parent=None, depth=0)
        return root

    def _walk_all(self):  # type: ignore[no-untyped-def]
        """Every node of every partition."""
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _path_to(node: RadixNode) -> set[RadixNode]:
    """``node`` and its ancestors (identity set: nodes compare by identity)."""
    path = set()
    walk: RadixNode | None = node
    while walk is not None:
        path.add(walk)
        walk = walk.parent
    return path
