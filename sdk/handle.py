"""The KV handle: metadata describing a KV state that lives in an engine.

A handle never carries tensors. It says which model, tokenizer and positional layout produced the
state, how many tokens it covers, where it lives, and its lineage: the operations and tokens that
produced it, enough to recompute the state from scratch when the KV itself is gone.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Op(str, Enum):
    """The operator that produced a lineage step."""

    MATERIALIZE = "materialize"
    FORK = "fork"
    EXTEND = "extend"
    RESUME = "resume"
    GENERATE = "generate"
    COMPOSE = "compose"
    TRANSFER = "transfer"  # moved to another worker with its K/V; tokens unchanged (approximate stays approximate)
    RECOMPUTE = "recompute"  # moved to another worker by dense prefill of its tokens; exact again


class LineageStep(BaseModel):
    """One operator application.

    Replaying the steps in order rebuilds the token sequence: keep the first ``keep`` tokens of the
    sequence so far (all of them when ``keep`` is None), then append ``token_ids``.
    """

    model_config = ConfigDict(frozen=True)

    op: Op
    parent: str | None = None
    keep: int | None = Field(default=None, ge=0)
    token_ids: tuple[int, ...] = ()


class Positions(BaseModel):
    """Positional layout of the cached keys: which RoPE variant rotated them, and from where."""

    model_config = ConfigDict(frozen=True)

    rope_type: str
    rope_theta: float
    rope_parameters: dict[str, Any] = Field(default_factory=dict)
    start: int = 0


class Placement(BaseModel):
    """Where the KV blocks of the state are."""

    model_config = ConfigDict(frozen=True)

    device: str
    tier: str = "device"
    worker: int | None = Field(default=None, description="Worker rank holding the blocks (multi-device servers).")


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids two sequences share: what a handle of ``a`` can give a prompt ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def new_handle_id() -> str:
    """An opaque random 128-bit id (32 hex characters)."""
    return secrets.token_hex(16)


class Handle(BaseModel):
    """A reference to KV state held by an engine. Pass it between agents instead of text."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    model: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    num_tokens: int = Field(ge=0)
    positions: Positions
    lineage: tuple[LineageStep, ...] = ()
    placement: Placement
    exact: bool = Field(
        default=True,
        description="False when part of the KV was re-aligned or corrected (compose) instead of computed "
        "densely; such state is never shared through the prefix cache, and recomputing it from its "
        "lineage gives the dense (exact) KV.",
    )

    def segment(self, start: int = 0, end: int | None = None, *, slot: str | None = None) -> Segment:
        """Tokens ``start..end-1`` of this handle as a segment to splice into another prompt (compose)."""
        return Segment(handle=self, start=start, end=end, slot=slot)

    def token_ids(self) -> list[int]:
        """The token ids this handle covers, rebuilt from its lineage."""
        tokens: list[int] = []
        for step in self.lineage:
            if step.keep is not None:
                del tokens[step.keep :]
            tokens.extend(step.token_ids)
        return tokens

    def __repr__(self) -> str:
        return f"Handle(id={self.id[:8]}…, model={self.model!r}, num_tokens={self.num_tokens})"

    __str__ = __repr__


HandleLike = Handle | str
"""A handle as the operators take it: the handle itself, or its id."""


class Segment(BaseModel):
    """A token range of a handle, spliced into another prompt by ``compose`` at whatever position it lands.

    ``slot`` names the role the segment plays (``"task"``, ``"document"``, ``"planner_output"``...):
    corrections learned for one slot are only applied to segments of the same slot.
    """

    model_config = ConfigDict(frozen=True)

    handle: Handle
    start: int = Field(default=0, ge=0)
    end: int | None = Field(default=None, ge=1)
    slot: str | None = Field(default=None, min_length=1, max_length=256)

    def bounds(self) -> tuple[int, int]:
        """``(start, end)`` with ``end`` resolved against the handle's length."""
        return self.start, self.handle.num_tokens if self.end is None else self.end
