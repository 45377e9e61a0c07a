"""Request and response models shared by every client and the engine.

They are pydantic models so that the boundary (SDK call, HTTP body) validates input once and
reports every problem in one clear error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .handle import Handle

MAX_STOP_STRINGS = 16


class SamplingParams(BaseModel):
    """How to pick tokens. ``temperature=0`` (the default) is greedy decoding."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(default=64, ge=1, description="Most tokens to generate.")
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k filtering.")
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: tuple[str, ...] = Field(default=(), max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class ChatMessage(BaseModel):
    """One chat message, as the model's chat template expects it."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class Timings(BaseModel):
    """What one request cost. Times are wall-clock seconds measured in the engine."""

    ttft_s: float = Field(description="Request start to first generated token.")
    total_s: float
    tokens_reused: int = Field(description="Prompt tokens whose KV came from a handle or the prefix cache.")
    tokens_prefilled: int = Field(description="Prompt tokens computed by this request.")
    tokens_generated: int


FinishReason = Literal["stop", "length"]


class Result(BaseModel):
    """The outcome of ``resume`` / ``generate``."""

    text: str
    token_ids: list[int] = Field(description="Generated token ids.")
    handle: Handle = Field(description="KV of prompt + generated tokens, ready to resume.")
    finish_reason: FinishReason
    timings: Timings


class StreamChunk(BaseModel):
    """A piece of streamed output: new text and the token ids that produced it."""

    text: str
    token_ids: list[int]


class AgentInfo(BaseModel):
    """A registered agent."""

    name: str
    fixed_tokens: int


class AgentStats(BaseModel):
    requests: int
    ttft_mean_s: float
    ttft_p90_s: float


class CacheStats(BaseModel):
    """Radix prefix cache and slow-tier counters."""

    policy: str
    tiers: list[str]
    hits_blocks: dict[str, int] = Field(description="Reused blocks by where they were found: device or a tier.")
    nodes_on_device: int
    nodes_per_tier: dict[str, int]
    bytes_offloaded: int
    bytes_prefetched: int
    bytes_loaded_on_demand: int
    blocks_prefetched: int
    prefetch_hits: int = Field(description="Prefetched blocks later used by a request.")
    prefetch_hit_rate: float
    tier_errors: int = Field(description="Slow-tier blocks that could not be read back (recomputed).")
    steps_to_execution: dict[str, float]


class Stats(BaseModel):
    """Pool and reuse counters of one engine."""

    model: str
    device: str
    dtype: str
    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_shared: int = Field(description="Blocks referenced by more than one handle or request.")
    blocks_cached: int = Field(default=0, description="Blocks held by the prefix cache.")
    blocks_cache_only: int = Field(default=0, description="Cached blocks no handle uses (evictable).")
    bytes_per_block: int
    pool_bytes_total: int
    pool_bytes_used: int
    pool_bytes_free: int
    handles_live: int
    tokens_reused: int
    tokens_prefilled: int
    tokens_generated: int
    cache: CacheStats | None = None
    agents: dict[str, AgentStats] = Field(default_factory=dict)
