"""Request and response bodies of the kvbaton server (native ``/v1/kv/...`` API and the OpenAI-compatible
endpoints). Responses of the native API reuse the SDK types (``Handle``, ``Result``, ``Stats``).

Invariant: the wire sampling fields are the SDK's :class:`~kvbaton.SamplingParams` itself
(:class:`Sampling` subclasses it), so their names, defaults and limits cannot drift apart.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kvbaton.errors import InvalidRequest
from kvbaton.handle import Handle
from kvbaton.types import MAX_TOP_LOGPROBS, ResponseFormat, Reuse, SamplingParams
from pydantic import BaseModel, ConfigDict, Field, StrictInt

# A handle in a request: its id, or the whole handle (then checked for compatibility with the server's model).
HandleRef = Handle | str
# Text, or token ids.
ContextIn = str | list[StrictInt]
# Longest agent tag on the wire: a tenant's prefix ("t-<16 hex>/") keeps the engine's name of it
# within kvbaton.ops.MAX_AGENT_CHARS.
MAX_AGENT_CHARS = 200


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable machine-readable code, the SDK exception's `code` (on the OpenAI routes "
                      "`context_length_exceeded` for `context_too_long`).")
    message: str
    type: str = Field(default="invalid_request_error", description="OpenAI's error type, from the HTTP status.")
    param: str | None = Field(default=None, description="The request field at fault, when one is.")


class ErrorBody(BaseModel):
    """The one error schema of every endpoint."""

    error: ErrorDetail


def _stop_takes_one_string(schema: dict[str, Any]) -> None:
    """``SamplingParams`` reads a lone stop string as a one-item list: say so in the schema."""
    stop = schema["properties"]["stop"]
    title, default = stop.pop("title", None), stop.pop("default", None)
    schema["properties"]["stop"] = {"anyOf": [{"type": "string"}, stop], "default": default, "title": title}


class Sampling(SamplingParams):
    """Sampling fields, flat in the request body: ``SamplingParams`` plus ``stream``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_stop_takes_one_string)

    stream: bool = Field(default=False, description="Answer with server-sent events (`chunk`..., then `result`).")

    def sampling_fields(self) -> dict[str, Any]:
        return self.model_dump(include=set(SamplingParams.model_fields))


Agent = Annotated[
    str, Field(min_length=1, max_length=MAX_AGENT_CHARS, description="Agent tag (or header X-Kvbaton-Agent).")
]


class MaterializeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    context: ContextIn
    agent: Agent | None = None


class ExtendRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    handle: HandleRef
    context: ContextIn
    agent: Agent | None = None


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    handle: HandleRef
    k: StrictInt = 2


class TransferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    handle: HandleRef
    device: StrictInt | str = Field(description="Target worker: its rank, or its device name when that is unique (e.g. 'cuda:1').")


class SegmentIn(BaseModel):
    """Tokens ``start..end-1`` of a handle, to splice into a composed prompt."""

    model_config = ConfigDict(extra="forbid")
    handle: HandleRef
    start: StrictInt = Field(default=0, ge=0)
    end: StrictInt | None = Field(default=None, ge=1)
    slot: str | None = Field(default=None, min_length=1, max_length=256)


class ComposeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefix_handle: HandleRef | None = Field(default=None, description="A handle whose K/V start the prompt.")
    prefix: ContextIn | None = Field(default=None, description="Text or token ids starting the prompt.")
    segments: list[SegmentIn] = Field(default_factory=list, max_length=256)
    suffix: ContextIn | None = None
    agent: Agent | None = None
    mode: Literal["auto", "rotate", "dense"] = "auto"
    correction: dict[str, Any] | None = Field(default=None, description="Anchor-pool settings for this call.")


class MergeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    parts: list[SegmentIn] = Field(min_length=1, max_length=256, description="Whole handles (no start/end/slot) "
                                   "merge when prefix-compatible; segments are concatenated.")
    agent: Agent | None = None
    mode: Literal["auto", "rotate", "dense"] = "auto"
    correction: dict[str, Any] | None = None


class FidelityRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    handle: HandleRef
    max_tokens: StrictInt = Field(default=32, ge=1, le=4096)
    reference: HandleRef | None = None


class ForkResponse(BaseModel):
    handles: list[Handle]


class ResumeRequest(Sampling):
    handle: HandleRef
    suffix: ContextIn = ""
    agent: Agent | None = None


ReuseField = Field(
    default=None,
    description="Reuse policy (or header X-Kvbaton-Reuse): 'exact' (greedy output identical to dense prefill), "
    "'auto' or 'rotate' (also spans other agents computed behind another prefix, approximately; the result's `exact` "
    "and `segments` say so). Default: the server's (--reuse, 'exact' unless set).",
)


class CompleteRequest(Sampling):
    prompt: ContextIn
    agent: Agent | None = None
    reuse: Reuse | None = ReuseField


class GenerateRequest(Sampling):
    messages: list[dict[str, Any]]
    handle: HandleRef | None = None
    tools: list[dict[str, Any]] | None = None
    agent: Agent | None = None
    reuse: Reuse | None = ReuseField


class ReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    handles: list[HandleRef] = Field(min_length=1)


class ReleaseResponse(BaseModel):
    released: int


class SessionReleased(BaseModel):
    session: str
    released: int = Field(description="Handles the session's agents retained, now released.")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


class TokenIds(BaseModel):
    token_ids: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_ids: list[StrictInt]


class Text(BaseModel):
    text: str


class ChatTokensRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


class RegisterAgentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Agent
    fixed_prompt: ContextIn | list[dict[str, Any]] = Field(
        description="Text, token ids, or chat messages (rendered without the generation prompt)."
    )
    prefill: bool = False


class AgentInfoOut(BaseModel):
    name: str
    fixed_tokens: int


class HintsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: dict[Agent, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description="Steps until each agent runs next."
    )
    running: list[Agent] = Field(default_factory=list, description="Agents running now (steps 0).")


class HintsResponse(BaseModel):
    steps: dict[str, float]


class Health(BaseModel):
    """``/health``: ``ok`` (200), or ``unhealthy`` (503) with the reason and the error schema's ``error``."""

    status: Literal["ok", "unhealthy"] = "ok"
    model: str
    version: str
    reason: str | None = Field(default=None, description="Why the engine cannot serve (unhealthy only).")
    error: ErrorDetail | None = Field(default=None, description="`server_unavailable` (unhealthy only).")


# -- OpenAI compatible ----------------------------------------------------------------------------


class KvbatonExtension(BaseModel):
    """The ``kvbaton`` body field of ``/v1/chat/completions`` (``extra_body={"kvbaton": {...}}``)."""

    model_config = ConfigDict(extra="forbid")

    agent: str | None = Field(default=None, max_length=MAX_AGENT_CHARS, description="Agent tag (also header X-Kvbaton-Agent).")
    handle: HandleRef | None = Field(default=None, description="A handle whose KV to reuse (longest common prefix).")
    step: str | int | None = Field(default=None, description="Workflow step tag, echoed back.")
    keep: bool = Field(
        default=False,
        description="Keep every result handle for the caller (who then releases them); by default the server "
        "keeps only the latest result handle per agent and releases the one before.",
    )
    reuse: Reuse | None = Field(
        default=None,
        description="Reuse policy (also header X-Kvbaton-Reuse): 'exact' (greedy output identical to dense "
        "prefill), 'auto' or 'rotate' (also spans other agents computed behind another prefix, approximately; the "
        "answer's kvbaton.exact and header X-Kvbaton-Approximate say so). Default: the server's (--reuse, 'exact' "
        "unless set).",
    )
    session: str | None = Field(
        default=None, min_length=1, max_length=MAX_AGENT_CHARS,
        description="Session whose retained handles this request uses (also header X-Kvbaton-Session, else the "
        "request's `user`); each session of an agent retains its own latest handle.",
    )
    top_k: int | None = Field(default=None, ge=0, description="As the top-level field (vLLM's extra).")
    ignore_eos: bool | None = Field(default=None, description="As the top-level field (vLLM's extra).")
    min_tokens: int | None = Field(default=None, ge=0, description="As the top-level field (vLLM's extra).")


# vLLM's sampling extras, accepted top-level and in the ``kvbaton`` field.
_EXTRA_SAMPLING = ("top_k", "ignore_eos", "min_tokens")


class OpenAIRequest(BaseModel):
    """What the OpenAI chat and (legacy) completion requests share. Undeclared fields are checked by
    ``server/openai_fields`` (ignored when harmless, else 400 naming them)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    top_k: int | None = Field(default=None, ge=0, description="vLLM's extra: sample from the k likeliest (0: off).")
    ignore_eos: bool | None = Field(default=None, description="vLLM's extra: generate past end-of-sequence.")
    min_tokens: int | None = Field(default=None, ge=0, description="vLLM's extra: no end-of-sequence or stop "
                                   "string before this many tokens.")
    kvbaton: KvbatonExtension | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """The ``SamplingParams`` fields the request sets (None: not given); vLLM's extras top-level or in
        the ``kvbaton`` field (given in both, they must agree)."""
        fields = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "stop": self.stop}
        ext = self.kvbaton
        for name in _EXTRA_SAMPLING:
            top, inner = getattr(self, name), getattr(ext, name) if ext is not None else None
            if top is not None and inner is not None and top != inner:
                raise InvalidRequest(f"{name} is {top!r} but kvbaton.{name} is {inner!r}", param=name)
            fields[name] = top if top is not None else inner
        return fields


class ChatCompletionRequest(OpenAIRequest):
    """The OpenAI chat completion request."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        default=None, description="'required' or a named function is enforced by constrained decoding.")
    parallel_tool_calls: bool | None = Field(default=None, description="Accepted; an answer holds at most the "
                                             "calls the model writes (one when a call is required).")
    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object or json_schema: enforced by constrained decoding.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def sampling_fields(self) -> dict[str, Any]:
        return {**super().sampling_fields(), "max_tokens": self.max_completion_tokens or self.max_tokens,
                "response_format": self.response_format, "logprobs": self.logprobs,
                "top_logprobs": self.top_logprobs}


class ResponsesRequest(OpenAIRequest):
    """The OpenAI Responses request, text only: ``input`` (text, or message items with text content),
    ``instructions`` (a system message), ``max_output_tokens``."""

    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)

    def sampling_fields(self) -> dict[str, Any]:
        return {**super().sampling_fields(), "max_tokens": self.max_output_tokens or self.max_tokens}


class CompletionRequest(OpenAIRequest):
    """The OpenAI (legacy) completion request: one prompt, text or token ids."""

    prompt: ContextIn | list[str] | list[list[StrictInt]]
    logprobs: int | None = Field(default=None, ge=0, le=5, description="Legacy: log probabilities of each token and "
                                 "of this many most likely alternatives.")

    def sampling_fields(self) -> dict[str, Any]:
        legacy = self.logprobs is not None
        return {**super().sampling_fields(), "logprobs": legacy or None,
                "top_logprobs": self.logprobs if legacy else None}
