"""Radix prefix cache over block-aligned token prefixes, with slow tiers behind the device pool.

Each node stands for one full KV block: its key is that block's ``block_size`` token ids, and
the path from the root spells the whole prefix the block's K/V depend on. The tree holds one
reference on the pool block of every on-device node; handles and running requests hold their own
references, so a block is evictable only when the tree's is the last one.

Node states: ``device`` (in the pool), ``offloading`` (being written to a slow tier; synchronous
here, so transient), ``slow`` (only in a slow tier), ``loading`` (pool block reserved, data on its
way back). A tier that fails (a full disk, its directory removed, an unreadable block) never fails
the request that made room: the block is dropped instead, as if no tier had room (its tokens are
recomputed when next needed), and the failure is counted in ``tier_errors``. Invariant: the ancestors of an on-device node are on the device too, because eviction
takes device leaves first and loading goes root to leaf. A node removed from the tree is
``dropped``, so code still holding an old path can tell.

The tree has one root per *scope* (a multi-tenant server's tenant; ``""`` by default): a prefix is
matched and inserted within one scope only, so one scope never reuses, waits on or loads back
another's blocks (nor learns from its timing what another sent). The pool, the tiers, eviction and
flush are shared by every scope.

Which candidate goes first is the eviction policy's business (``eviction.py``); the tree only
knows which nodes may go.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from .block_pool import BlockPool
from .eviction import EvictionPolicy
from .blockfile import BlockDataError
from .tiers import Tier

log = logging.getLogger(__name__)


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
    parent: RadixNode | None
    depth: int  # blocks from the root; the node covers tokens (depth-1)*bs .. depth*bs-1
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
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
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.tier_policy = tier_policy or policy  # order inside the slow tiers (the same unless ablating)
        self.tiers = list(tiers)
        self.bs = pool.block_size
        self.root = RadixNode(id=0, key=(), parent=None, depth=0)  # scope "": the one scope by default
        self._roots: dict[str, RadixNode] = {"": self.root}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._agents: dict[str, tuple[str, list[int]]] = {}  # name -> (scope, fixed tokens)
        self._in_tier: list[set[RadixNode]] = [set() for _ in self.tiers]
        self.device_nodes = 0
        self.bytes_offloaded = 0
        self.nodes_dropped = 0
        self.tier_errors = 0
        # Told of each eviction round: the nodes evicted and where they went (a tier's name or "dropped").
        self.on_evict: Callable[[list[RadixNode], str], None] | None = None

    # -- agents -------------------------------------------------------------------------------
    def register_agent(self, name: str, fixed_tokens: Sequence[int], scope: str = "") -> None:
        """Tag the nodes of ``name``'s fixed prompt in ``scope`` (now and as they are inserted later)."""
        for node in self._walk_all():
            node.owners.discard(name)
        self._agents[name] = (scope, list(fixed_tokens))
        node = self._root(scope)
        for key in self._keys(fixed_tokens, len(fixed_tokens) // self.bs):
            node = node.children.get(key)  # type: ignore[assignment]
            if node is None:
                break
            node.owners.add(name)

    def fixed_path(self, name: str) -> list[RadixNode]:
        """The nodes of ``name``'s fixed prompt, in the scope it was registered in."""
        scope, tokens = self._agents.get(name, ("", []))
        return self.match(tokens, len(tokens), touch=False, scope=scope)

    # -- lookup and insertion -------------------------------------------------------------------
    def match(
        self, tokens: Sequence[int], max_tokens: int, touch: bool = True, scope: str = ""
    ) -> list[RadixNode]:
        """Nodes (any state) spelling the longest block-aligned prefix of ``tokens[:max_tokens]`` cached in ``scope``."""
        path: list[RadixNode] = []
        node = self._roots.get(scope)
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

    def insert(self, tokens: Sequence[int], blocks: list[int], num_full: int, scope: str = "") -> None:
        """Cache the first ``num_full`` blocks of a sequence whose K/V are in ``blocks``, in ``scope``.

        Where the tree already holds a block for the same prefix, the sequence switches to the
        tree's copy (``blocks`` is updated in place, references moved), so identical prefixes are
        stored once (per scope). A node waiting in a slow tier is revived from the sequence's block for free.
        """
        if num_full <= 0:
            return
        node = self._root(scope)
        now = next(self._clock)
        for i, key in enumerate(self._keys(tokens, num_full)):
            child = node.children.get(key)
            if child is None:
                child = RadixNode(id=next(self._ids), key=key, parent=node, depth=node.depth + 1, block=blocks[i])
                child.owners = self._owners_for(node, key, child.depth, scope)
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
            child.last_access = now
            node = child

    # -- eviction -------------------------------------------------------------------------------
    def evictable(self, node: RadixNode) -> bool:
        return (
            node.state is NodeState.DEVICE
            and node.block is not None
            and self.pool.refcount(node.block) == 1
            and not any(c.state in (NodeState.DEVICE, NodeState.LOADING) for c in node.children.values())
        )

    def evict(self, n: int, allowed: Callable[[RadixNode], bool] | None = None) -> int:
        """Free up to ``n`` pool blocks, offloading to the first slow tier when there is one."""
        heap = [
            (self.policy.priority(node), node.id, node)
            for node in self._walk_all()
            if self.evictable(node) and (allowed is None or allowed(node))
        ]
        heapq.heapify(heap)
        freed = 0
        evicted: list[RadixNode] = []
        while heap and freed < n:
            _, _, node = heapq.heappop(heap)
            if not self.evictable(node):
                continue
            parent = node.parent
            self._evict_one(node)
            evicted.append(node)
            freed += 1
            if parent is not None and parent.parent is not None and self.evictable(parent):  # not a root
                if allowed is None or allowed(parent):
                    heapq.heappush(heap, (self.policy.priority(parent), parent.id, parent))
        if evicted and self.on_evict is not None:
            self.on_evict(evicted, self.tiers[0].name if self.tiers else "dropped")
        return freed

    def _evict_one(self, node: RadixNode) -> None:
        block = node.block
        assert block is not None
        node.state = NodeState.OFFLOADING
        if self.tiers:
            k, v = self.pool.read_block(block)
            if self._store(0, node, k, v):
                self.bytes_offloaded += k.nbytes + v.nbytes
        else:
            self._detach(node)
        self.pool.decref([block])
        node.block = None
        self.device_nodes -= 1

    def _store(self, index: int, node: RadixNode, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Put a node's data in tier ``index``; if no room can be made, drop the node instead."""
        tier = self.tiers[index]
        while tier.full:
            if not self._make_room(index, exclude=node):
                self._drop_subtree(node)
                return False
        try:
            tier.put(node.id, k, v)
        except Exception as exc:  # a full disk, a removed directory: drop the block, never fail the request
            self.tier_failed(tier, "write", exc)
            self._drop_subtree(node)
            return False
        node.state, node.tier = NodeState.SLOW, index
        self._in_tier[index].add(node)
        return True

    def _make_room(self, index: int, exclude: RadixNode) -> bool:
        """Move the lowest-priority block of tier ``index`` one tier down, or drop it from the last."""
        candidates = [nd for nd in self._in_tier[index] if not _is_ancestor(nd, exclude)]
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
        for node in nodes:
            if node.state is NodeState.DROPPED:
                break  # making room dropped it (and so everything below it): the rest is gone
            if node.state is not NodeState.SLOW:
                continue
            if self.pool.num_free == 0:
                def may_go(other: RadixNode) -> bool:
                    return id(other) not in protected and (allowed is None or allowed(other))

                self.evict(1, may_go)  # may make room in a tier by dropping this very node
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
        if node.state is not NodeState.LOADING:
            return False
        if data is None:  # the reader could not read it back (and logged why)
            self.tier_errors += 1
            self._drop_subtree(node)
            return False
        assert node.block is not None
        self.pool.write_block(node.block, *data)
        self._forget_tier_copy(node)
        node.state = NodeState.DEVICE
        return True

    def tier_failed(self, tier: Tier, what: str, exc: BaseException) -> None:
        """Count a tier failure; log the 1st, 2nd, 4th, 8th... so a full disk cannot flood the log."""
        self.tier_errors += 1
        if self.tier_errors & (self.tier_errors - 1) == 0:
            log.warning("%s tier %s failed (%s); the block is dropped and its tokens recomputed when needed "
                        "[%d tier errors so far]", tier.name, what, exc, self.tier_errors)

    # -- bookkeeping ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every cached prefix that nothing else references (all tiers, every scope)."""
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
        for child in list(node.children.values()):
            self._drop_subtree(child)
        if node.state in (NodeState.DEVICE, NodeState.LOADING) and node.block is not None:
            self.pool.decref([node.block])
            self.device_nodes -= 1
        node.block = None
        self._forget_tier_copy(node)
        self._detach(node)
        self.nodes_dropped += 1

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

    def _owners_for(self, parent: RadixNode, key: tuple[int, ...], depth: int, scope: str) -> set[str]:
        owners = set()
        for name, (agent_scope, fixed) in self._agents.items():
            if agent_scope != scope:
                continue
            if (parent.parent is None or name in parent.owners) and depth * self.bs <= len(fixed):
                if tuple(fixed[(depth - 1) * self.bs : depth * self.bs]) == key:
                    owners.add(name)
        return owners

    def _keys(self, tokens: Sequence[int], num_blocks: int):  # type: ignore[no-untyped-def]
        bs = self.bs
        for i in range(num_blocks):
            yield tuple(tokens[i * bs : (i + 1) * bs])

    def _root(self, scope: str) -> RadixNode:
        root = self._roots.get(scope)
        if root is None:
            root = self._roots[scope] = RadixNode(id=next(self._ids), key=(), parent=None, depth=0)
        return root

    def _walk_all(self):  # type: ignore[no-untyped-def]
        """Every node of every scope."""
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _is_ancestor(node: RadixNode, of: RadixNode) -> bool:
    """True when ``node`` is ``of`` or one of its ancestors (dropping it would drop ``of``)."""
    walk: RadixNode | None = of
    while walk is not None:
        if walk is node:
            return True
        walk = walk.parent
    return False
