"""Eviction policies for the radix prefix cache, each a single priority function.

``priority(node)`` returns a sortable key; the node with the smallest key is evicted first. The
cache decides which nodes are candidates (unpinned leaves); the policy only orders them. The same
order is used in every tier.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from typing import Any, Protocol


class CacheNode(Protocol):
    last_access: int
    owners: set[str]


class EvictionPolicy(abc.ABC):
    name: str

    @abc.abstractmethod
    def priority(self, node: CacheNode) -> tuple[Any, ...]: ...


class LRU(EvictionPolicy):
    """Least recently used first: the baseline of today's serving engines."""

    name = "lru"

    def priority(self, node: CacheNode) -> tuple[Any, ...]:
        return (node.last_access,)


class StepsToExecution(EvictionPolicy):
    """KVFlow's workflow-aware order.

    A node that belongs to some agent's fixed prompt takes the MIN steps-to-execution of its
    owners (the soonest user protects a shared prefix). Dynamic suffixes (no owner) go first, then
    fixed prompts from the farthest STE down; ties by least recent use. Agents without a hint
    count as infinitely far.
    """

    name = "ste"

    def __init__(self, ste: Mapping[str, float]) -> None:
        self._ste = ste  # live view of the engine's hint table

    def node_ste(self, node: CacheNode) -> float:
        return min((self._ste.get(agent, math.inf) for agent in node.owners), default=math.inf)

    def priority(self, node: CacheNode) -> tuple[Any, ...]:
        if not node.owners:
            return (0, 0.0, node.last_access)
        return (1, -self.node_ste(node), node.last_access)


def make_policy(name: str, ste: Mapping[str, float]) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "ste":
        return StepsToExecution(ste)
    from kvbaton.errors import InvalidRequest

    raise InvalidRequest(f"unknown eviction policy {name!r}: use 'ste' or 'lru'")
