"""The engine-side KV state behind a handle."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from kvbaton.handle import LineageStep


@dataclass
class KVState:
    """Tokens, the blocks holding their K/V, and the lineage that produced them.

    ``num_cached`` tokens have K/V in ``blocks``; the rest (at most the last generated token of a
    ``resume``) are computed on next use. ``last_logits`` are the next-token logits after the last
    token when known, so a state can be resumed with an empty suffix without recomputing anything.
    From ``exact_len`` on, K/V were re-aligned or corrected rather than computed densely (and tokens
    computed behind them inherit the approximation): such blocks never enter the prefix cache.
    """

    id: str
    token_ids: list[int]
    blocks: list[int]
    num_cached: int
    lineage: tuple[LineageStep, ...]
    last_logits: torch.Tensor | None = None
    agent: str | None = None  # the agent that produced the state (its label): the source side of a correction edge
    tenant: str | None = None  # the tenant whose request produced it: its cache and span partitions derive from it
    session: str | None = None  # the session (workflow run) whose request produced it: its span partition may follow it
    exact_len: int | None = None  # first position whose K/V is approximate (compose); None: all exact
    cacheable: bool = True  # False for private measurement states (fidelity references) and their children
    # Cached positions whose K/V the next forward recomputes (a blended segment's most-deviating tokens),
    # ascending: they ride along with the tokens after them instead of costing a forward of their own.
    stale: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def view(self) -> KVState:
        """A reader's copy of this state as it is now: releasing the state (which empties its block list)
        leaves the view's blocks as they were, readable for as long as the reader pins them."""
        return dataclasses.replace(self, blocks=list(self.blocks), stale=list(self.stale))
