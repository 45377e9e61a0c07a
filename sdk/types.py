"""Request and response models shared by every client and the engine.

They are pydantic models so that the boundary (SDK call, HTTP body) validates input once and
reports every problem in one clear error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .handle import Handle

MAX_STOP_STRINGS = 16

Reuse = Literal["exact", "auto", "rotate", "correct"]
"""How a request may reuse K/V that another context computed (docs/segments.md, "Automatic reuse"):

- ``"exact"``: only K/V this engine computed densely for the same tokens: the longest common prefix
  with the request's handle (its exact part: an approximate handle's rest is recomputed) or the prefix
  cache. In float32, greedy output is token-identical to dense prefill.
- ``"auto"``: also known spans of other agents' prompts behind a different prefix (a shared document
  behind another system prompt): re-aligned to the new positions, their most-deviating tokens
  recomputed (selective recomputation), and recomputed densely when the answer looks unsure. The
  result is marked approximate.
- ``"rotate"``: re-align such spans without any correction (fastest, least faithful; marked).
- ``"correct"``: re-align such spans and add the context deviation estimated from an anchor pool
  (KVCMAS's chained low-rank correction); spans without enough anchors are recomputed densely and
  become anchors; gated like ``"auto"`` (marked).
"""
REUSE_POLICIES: tuple[str, ...] = ("exact", "auto", "rotate", "correct")

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class ResponseFormat(BaseModel):
    """What the output must be, OpenAI's ``response_format``: ``text`` (anything), ``json_object`` (one
    JSON object) or ``json_schema`` (JSON valid for ``json_schema["schema"]``; also ``name``,
    ``description``, ``strict``). The engine enforces it while decoding (docs/sdk.md, "Structured output")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(
        default=None, description="For type json_schema: {name, schema, description?, strict?}."
    )

    @field_validator("json_schema")
    @classmethod
    def _has_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and not isinstance(value.get("schema", {}), dict | bool):
            raise ValueError("json_schema.schema must be a JSON schema object")
        return value

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


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
    min_tokens: int = Field(
        default=0, ge=0, description="Fewest tokens to generate: end-of-sequence and stop strings do not end the "
        "generation before (a stop string counts once it ends in the text of token `min_tokens` or later).",
    )
    response_format: ResponseFormat | None = Field(
        default=None, description="Constrain the output (JSON, a JSON schema); None or type 'text': unconstrained."
    )
    logprobs: bool = Field(default=False, description="Report the log probability of each generated token.")
    top_logprobs: int = Field(
        default=0, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: this many most likely alternatives per token."
    )

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        if self.min_tokens and self.response_format is not None and self.response_format.type != "text":
            # a complete JSON value may leave only end-of-sequence allowed: nothing could be sampled
            raise ValueError("min_tokens cannot be combined with a JSON response_format")
        return self

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
    tokens_approximate: int = Field(
        default=0,
        description="Of ``tokens_reused``, the prompt tokens whose K/V were re-aligned (and corrected) from another "
        "context rather than token-identical to dense prefill (``reuse='auto'``, ``'rotate'`` or ``'correct'``).",
    )
    tokens_discarded: int = Field(
        default=0,
        description="Work the confidence gate threw away: prompt tokens run through the model for an approximation "
        "it then rejected (recomputing the prompt densely instead), a pass over the first layers only counted as "
        "its share of the layers. 0 unless the gate rejected.",
    )
    tokens_recomputed: int = Field(
        default=0,
        description="Of ``tokens_prefilled``, the tokens of spans found in other agents' K/V that were computed "
        "anyway: a blended span's most-deviating tokens, and spans prefilled (each span's reason in ``segments``).",
    )


FinishReason = Literal["stop", "length"]


class TopLogprob(BaseModel):
    """One candidate token at a step, with its log probability under the model."""

    token_id: int
    token: str = Field(description="The token's text; a token that is part of a character (a byte-level BPE "
                       "fragment) is written as OpenAI writes it, ``bytes:`` and its bytes escaped (``bytes:\\xe4\\xbd``).")
    logprob: float
    bytes: list[int] = Field(default_factory=list, description="The token's own bytes: its UTF-8 text, or the part "
                             "of a character it is.")


class TokenLogprob(TopLogprob):
    """A generated token's log probability, and the most likely tokens at its step (``top_logprobs``).
    Log probabilities are the model's own (temperature 1, before any response-format constraint)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class PromptTokenLogprob(TokenLogprob):
    """A prompt token's log probability after the tokens before it, and the most likely tokens there
    (``Engine.prompt_logprobs``: the scoring of lm-eval-style harnesses). The first token has none."""

    logprob: float | None = Field(description="None for the prompt's first token: nothing precedes it.")


class Result(BaseModel):
    """The outcome of ``resume`` / ``generate``."""

    text: str
    token_ids: list[int] = Field(description="Generated token ids.")
    handle: Handle = Field(description="KV of prompt + generated tokens, ready to resume.")
    finish_reason: FinishReason
    timings: Timings
    exact: bool = Field(
        default=True,
        description="True when no prompt token's K/V was approximated: all are this engine's own dense prefill of "
        "the same tokens (reused from a handle or the prefix cache, or computed now); False when the request reused "
        "approximate K/V (``reuse='auto'`` / ``'rotate'`` / ``'correct'``). What exact promises about the output: "
        "``token_identical``.",
    )
    token_identical: bool = Field(
        default=True,
        description="True when greedy output is guaranteed token-identical to a dense prefill of the same prompt: "
        "an exact result of a float32 engine (tested). False for approximate results, and for every result in "
        "bfloat16 / float16: there an exact result's K/V are still this engine's own dense prefill, but a "
        "prefix-cache hit splits the prompt's computation differently from a fresh prefill and rounds "
        "differently, so greedy output agrees with a fresh dense prefill only most of the time (README.md).",
    )
    segments: list[SegmentReport] = Field(
        default_factory=list,
        description="Spans of other contexts this request placed behind its own prefix, and what was done with each.",
    )
    logprobs: list[TokenLogprob] | None = Field(
        default=None, description="Per generated token, with ``logprobs=True``: its log probability and alternatives."
    )


class StreamChunk(BaseModel):
    """A piece of streamed output: new text and the token ids that produced it."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = Field(default=None, description="Of ``token_ids``, with ``logprobs=True``.")
    exact: bool | None = Field(
        default=None,
        description="On a stream's first chunk: whether the prompt's K/V are exact (as ``Result.exact``, known once "
        "the prompt is computed, before the first token); None on the others.",
    )


class AgentInfo(BaseModel):
    """A registered agent."""

    name: str
    fixed_tokens: int


class AgentStats(BaseModel):
    """One agent's requests and time to first token. Bounded on the engine: the mean and p90 are over
    the agent's last 1,024 requests, and only the 1,024 most recently seen agents are listed."""

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
    tier_capacity_blocks: dict[str, int] = Field(
        default_factory=dict, description="How many blocks each slow tier holds at most (its size / bytes per block)."
    )
    bytes_offloaded: int
    bytes_prefetched: int
    bytes_loaded_on_demand: int
    blocks_prefetched: int
    prefetch_hits: int = Field(description="Prefetched blocks later used by a request.")
    prefetch_hit_rate: float
    tier_errors: int = Field(
        description="Slow-tier writes, reads or deletes that failed (the block dropped; recomputed when needed)."
    )
    handles_spilled: int = Field(
        default=0, description="Idle live handles whose blocks went to a slow tier or were dropped to make room."
    )
    steps_to_execution: dict[str, float]


class PlacementDecision(BaseModel):
    """How a handle reached another worker: KV transfer or recompute from lineage, predicted vs measured."""

    handle: str
    src: int | None = Field(description="Worker the handle lived on; None when that worker was lost.")
    dst: int
    reason: str = Field(
        description="'explicit' (transfer call), 'balance' (queue lengths), 'colocate' (compose/merge/fidelity "
        "need the handles on one worker) or 'lost' (worker died)."
    )
    tokens: int
    bytes: int
    predicted_transfer_s: float | None
    predicted_recompute_s: float
    choice: str = Field(description="'transfer' or 'recompute'.")
    actual_s: float


class WorkerStats(BaseModel):
    """One worker of a multi-device server."""

    rank: int
    device: str
    alive: bool
    pid: int | None = None
    host: str | None = None
    queue: int = Field(description="Requests in flight on the worker.")
    handles: int = Field(description="Live handles the coordinator has placed on the worker.")
    prefill_tokens_per_s: float | None = None
    collective: bool | None = Field(default=None, description=(
        "Whether KV moves to and from the worker over the collective group (NCCL or gloo); False: Ray's object "
        "store (a worker Ray restarted leaves the group); None: the cluster has no group."))
    stats: Stats | None = Field(default=None, description="The worker engine's own stats (None when it is down).")


class ClusterStats(BaseModel):
    """Coordinator view of a multi-device server: workers, link calibration and placement decisions."""

    workers: list[WorkerStats]
    bandwidth_bytes_per_s: float | None
    latency_s: float | None
    bandwidth_cap_bytes_per_s: float | None = None
    transfers: int = 0
    recomputes: int = 0
    retries: int = Field(default=0, description="Requests re-run on another worker after their worker died.")
    decisions: list[PlacementDecision] = Field(default_factory=list, description="The most recent decisions.")


class AuditAgentStats(BaseModel):
    """The sampled fidelity check of one agent's approximate answers."""

    checked: int
    agreed: int = Field(description="Checks whose next-token argmax equalled dense prefill's.")
    gate_raised: float = Field(
        description="Multiplier of the confidence-gate margin for this agent (1: as configured; doubled each "
        "time its agreement is measured below the target)."
    )


class AuditStats(BaseModel):
    """Sampled online check of approximate answers against dense prefill (off the request path)."""

    fraction: float = Field(description="Share of approximate requests checked (every 1/fraction-th).")
    target: float = Field(description="First-token agreement below which an agent's gate is raised.")
    checked: int
    agreed: int
    dropped: int = Field(description="Checks skipped because the check queue was full.")
    agents: dict[str, AuditAgentStats] = Field(default_factory=dict)


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
    blocks_retained_only: int = Field(
        default=0, description="Blocks only released approximate turns hold, kept for their agent's next turn "
                               "(a cache: dropped first when a request needs blocks).")
    bytes_per_block: int
    pool_bytes_total: int
    pool_bytes_used: int
    pool_bytes_free: int
    handles_live: int
    tokens_reused: int
    tokens_prefilled: int
    tokens_generated: int
    tokens_approximate: int = Field(
        default=0,
        description="Of tokens_reused, those re-aligned from another context (reuse='auto'/'rotate'/'correct').",
    )
    tokens_discarded: int = Field(
        default=0, description="Work the confidence gate threw away, summed over requests (Timings.tokens_discarded)."
    )
    tokens_recomputed: int = Field(
        default=0, description="Found spans' tokens computed anyway, summed over requests (Timings.tokens_recomputed)."
    )
    cache: CacheStats | None = None
    audit: AuditStats | None = Field(
        default=None, description="The sampled fidelity check of approximate answers (engines that approximate)."
    )
    agents: dict[str, AgentStats] = Field(default_factory=dict)
    cluster: ClusterStats | None = Field(default=None, description="Multi-device servers only: per-worker view.")


class SegmentReport(BaseModel):
    """What ``compose`` did with one segment, and why."""

    index: int
    source: str = Field(description="Id of the handle the segment came from.")
    start: int = Field(description="First token of the segment in its source handle.")
    end: int
    offset: int = Field(description="Position of the segment's first token in the composed prompt.")
    outcome: Literal["exact", "rotated", "corrected", "blended", "recomputed"] = Field(
        description="exact: same tokens before it, KV reused as is; rotated: keys re-aligned to the new "
        "positions, no correction; corrected: re-aligned plus a low-rank estimate of the context deviation; "
        "blended: re-aligned, then its most-deviating tokens recomputed behind the new prefix (selective "
        "recomputation); recomputed: prefilled densely behind the new prefix."
    )
    reason: str
    tokens_reused: int = Field(description="Tokens whose K/V came from the source instead of a prefill.")
    tokens_cached: int = Field(
        default=0,
        description="Leading tokens of the segment already found exactly in the prefix cache (or the request's "
        "handle): only the rest was placed.",
    )
    exact: bool = Field(
        default=True,
        description="False when this segment's K/V differ from dense prefill of the whole prompt: approximated "
        "(rotated, corrected, blended), or computed behind approximate K/V earlier in the prompt.",
    )
    anchors: int = Field(default=0, description="Anchors in the slot's pool when the decision was made.")
    entropy: float | None = Field(default=None, description="Normalized entropy of the anchor weights.")


class Composition(BaseModel):
    """The result of ``compose`` / ``merge``: a handle to the assembled prompt and a per-segment report."""

    handle: Handle
    segments: list[SegmentReport]
    exact: bool = Field(description="True when every token's K/V equals dense prefill of the same prompt.")
    tokens_reused: int
    tokens_prefilled: int
    compose_s: float = Field(description="Wall time of the composition, prefill of the remainder included.")
    margin: float | None = Field(
        default=None,
        description="Top-1 minus top-2 next-token logit after the approximated prompt (before any confidence "
        "fallback); None when nothing was approximated.",
    )


class Fidelity(BaseModel):
    """How closely a handle's KV reproduces dense prefill of its tokens (measured on demand)."""

    tokens: int = Field(description="Greedy tokens compared.")
    first_token_agrees: bool
    greedy_agreement: float = Field(
        description="Share of the greedy continuation identical to dense prefill's before the first divergence."
    )
    kl_mean: float = Field(
        description="Mean KL(dense || handle) of the next-token distributions along dense prefill's greedy "
        "continuation (nats)."
    )
    kl_first: float = Field(description="KL of the first next-token distribution (nats).")
    dense_token_ids: list[int]
    handle_token_ids: list[int]


EventKind = Literal["request", "evict", "prefetch"]


class Event(BaseModel):
    """One thing the engine did, for timelines (``client.events()``, the server's ``/dashboard``).

    ``request``: one request from submission to its handle (generation or prefill), with the
    times of its phases and where its prompt's K/V came from. ``evict``: prefix-cache blocks the
    eviction policy pushed to a slow tier (or dropped), with the steps-to-execution that ranked
    them. ``prefetch``: blocks brought back from a slow tier ahead of an agent's turn. Times are
    wall-clock seconds since the epoch (``time.time()``), so workers of one machine line up.
    """

    seq: int = Field(description="Monotonic sequence number in the engine's event ring (from 1).")
    kind: EventKind
    time: float = Field(description="When the event ended (seconds since the epoch).")
    agent: str | None = Field(default=None, description="The agent the request or prefetch was for.")
    tenant: str | None = Field(default=None, description="The tenant id on a multi-tenant server, else None.")
    worker: int | None = Field(default=None, description="The worker rank on a multi-device server.")
    # request events
    request_id: str | None = None
    op: str | None = Field(default=None, description="The operator: generate, resume, materialize, extend...")
    finish: str | None = Field(
        default=None, description="stop / length for a generation, done for a prefill, error or abandoned otherwise."
    )
    t_queued: float | None = Field(default=None, description="Submitted to the engine.")
    t_admitted: float | None = Field(
        default=None,
        description="Cached prefix attached (slow-tier loads included) and blocks reserved: prefill starts.",
    )
    t_first_token: float | None = Field(default=None, description="First generated token: prefill ends, decode starts.")
    t_done: float | None = None
    tokens_reused: int = Field(default=0, description="Prompt tokens reused exactly or approximately.")
    tokens_approximate: int = Field(default=0, description="Of tokens_reused, those reused approximately.")
    tokens_recomputed: int = Field(
        default=0, description="Of tokens_prefilled, found spans' tokens computed anyway (Timings.tokens_recomputed)."
    )
    reasons: list[str] = Field(
        default_factory=list, description="Why found spans were recomputed or prefilled (their segments' reasons).",
    )
    tokens_prefilled: int = 0
    tokens_generated: int = 0
    handle_in: str | None = Field(default=None, description="The parent handle the request continued, if any.")
    handle_out: str | None = Field(default=None, description="The handle it made (None when it failed).")
    blocks_loaded: dict[str, int] = Field(
        default_factory=dict,
        description="Prefix-cache blocks attached by where they were: device, or the slow tier read back.",
    )
    prefetch_hits: int = Field(default=0, description="Attached blocks that prefetch had brought back.")
    ste_predicted: float | None = Field(
        default=None,
        description="The agent's steps-to-execution in the hints just before they marked it running: 1 means "
        "the step graph predicted it as the next agent (None: no hint named it, or it was never marked running).",
    )
    background: bool = Field(
        default=False, description="The engine's own work (a fidelity audit's dense check), not a user's request.",
    )
    # cache events
    blocks: int = Field(default=0, description="evict / prefetch: blocks moved.")
    tier: str | None = Field(
        default=None, description="evict: the tier the blocks went to ('dropped': none); prefetch: the tier read."
    )
    policy: str | None = Field(default=None, description="evict: the eviction policy that chose the blocks.")
    steps_to_execution: dict[str, float | None] = Field(
        default_factory=dict,
        description="evict: the owner agents of the evicted blocks and their steps-to-execution (None: no hint).",
    )


class Events(BaseModel):
    """A page of the event ring: the events after ``since``, and where to continue."""

    events: list[Event]
    next: int = Field(description="Pass as ``since`` to get only later events.")
    dropped: int = Field(
        default=0, description="Events after ``since`` that the bounded ring no longer holds (read more often)."
    )
    capacity: int = Field(default=0, description="How many events the ring keeps.")


Result.model_rebuild()
