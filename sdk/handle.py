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
