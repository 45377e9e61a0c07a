"""What an engine behind a client can do with KV handles: ``client.capabilities()``.

kvbaton's own engine and SGLang (through the kvbaton plugin) serve the same SDK, but not every
operation is equally cheap or exact on both. Each operation reports one :data:`Support` level, so
callers (and the adapters) can choose, e.g., to replay text instead of reusing a shifted segment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Support = Literal["exact", "corrected", "recompute", "unsupported"]
"""``exact``: reused KV, token-identical to dense prefill under greedy decoding. ``corrected``: reused
KV repaired to approximate dense prefill (re-rotated keys plus recomputed tokens). ``recompute``:
works, but the engine prefills the tokens again (dense prefill). ``unsupported``: raises."""


class Capabilities(BaseModel):
    """Per-operation support of one engine."""

    model_config = ConfigDict(frozen=True)

    engine: str = Field(description='"kvbaton" (its own engine) or "sglang" (SGLang + the kvbaton plugin).')
    materialize: Support
    fork: Support = Field(description="k handles sharing a prefix's KV.")
    extend: Support
    resume: Support = Field(description="Generation behind a handle, reusing its KV.")
    generate: Support = Field(description="Chat generation reusing a handle's longest common token prefix.")
    shifted_segments: Support = Field(
        description="Reusing a segment's KV at another position or behind another prefix (compose / merge)."
    )
    transfer: Support = Field(description="Moving a handle's KV to another device of the backend.")
    handles_pinned: bool = Field(
        description="A live handle's KV is never evicted (False: it may be, and is then recomputed)."
    )
    workflow_eviction: bool = Field(description="Steps-to-execution eviction from hints / register_agent.")
    prefetch: bool = Field(description="Slow-tier KV of agents due soon is loaded ahead of their request.")
    streaming: bool = True


KVBATON = Capabilities(
    engine="kvbaton",
    materialize="exact",
    fork="exact",
    extend="exact",
    resume="exact",
    generate="exact",
    shifted_segments="corrected",
    transfer="exact",
    handles_pinned=True,
    workflow_eviction=True,
    prefetch=True,
)
"""kvbaton's own engine (embedded, or behind ``kvbaton serve``)."""

SGLANG = KVBATON.model_copy(
    update={"engine": "sglang", "shifted_segments": "recompute", "transfer": "unsupported", "handles_pinned": False}
)
"""SGLang 0.5.23 with the kvbaton plugin, where it differs from kvbaton's own engine: handles are token
prefixes in its radix tree, so an evicted prefix is prefilled again (still exact, not pinned); segments
at new positions are prefilled densely; KV does not move between devices."""
