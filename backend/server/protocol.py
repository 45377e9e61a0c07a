"""Bodies of the kvbaton server's own endpoints: the error schema, ``/health``, and the OpenAI-compatible
API. The native ``/v1/kv/...`` API's bodies are the SDK's (:mod:`kvbaton.wire`): both ends share them.
"""

from __future__ import annotations

from typing import Any, Literal

from kvbaton.errors import InvalidRequest
from kvbaton.ops import MAX_AGENT_CHARS
from kvbaton.types import MAX_TOP_LOGPROBS, ResponseFormat, Reuse, SegmentReport, Timings
from kvbaton.wire import ContextIn, HandleRef
from pydantic import BaseModel, ConfigDict, Field, StrictInt


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable machine-readable code, the SDK exception's `code` (on the OpenAI routes "
                      "`context_length_exceeded` for `context_too_long`).")
    message: str
    type: str = Field(default="invalid_request_error", description="OpenAI's error type, from the HTTP status.")
    param: str | None = Field(default=None, description="The request field at fault, when one is.")


class ErrorBody(BaseModel):
    """The one error schema of every endpoint."""

    error: ErrorDetail


class SessionReleased(BaseModel):
    session: str
    released: int = Field(description="Handles the session's agents retained, now released.")


class Health(BaseModel):
    """``/health``: ``ok`` (200); ``degraded`` with the reason: 200 while it serves every request with less
    (a cluster worker down), 503 with the error schema's ``error`` while the requests that make a handle fail
    (the handle journal cannot be written); or ``unhealthy`` (503) with the reason and ``error``."""

    status: Literal["ok", "degraded", "unhealthy"] = "ok"
    model: str
    version: str
    reason: str | None = Field(default=None, description="Why the engine serves degraded or cannot serve (degraded: "
                               "a cluster worker down, or the handle journal cannot be written).")
    error: ErrorDetail | None = Field(default=None, description="`server_unavailable` (unhealthy, or degraded with "
                                      "a 503).")


# -- OpenAI compatible ----------------------------------------------------------------------------


class KvbatonExtension(BaseModel):
    """The ``kvbaton`` body field of ``/v1/chat/completions`` (``extra_body={"kvbaton": {...}}``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

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
        description="Reuse policy (also header X-Kvbaton-Reuse): 'exact' (no approximate K/V; in float32 greedy "
        "output identical to dense prefill), 'auto', 'rotate' or 'correct' (also spans other agents of the session "
        "computed behind another prefix, approximately; the answer's kvbaton.exact and header "
        "X-Kvbaton-Approximate say so). Default: the server's (--reuse, 'exact' unless set).",
    )
    session: str | None = Field(
        default=None, min_length=1, max_length=MAX_AGENT_CHARS,
        description="Session whose retained handles this request uses (also header X-Kvbaton-Session, else the "
        "request's `user`); each session of an agent retains its own latest handle, and approximate reuse places "
        "only spans of the request's own session (--span-partition).",
    )
    top_k: int | None = Field(default=None, ge=-1, description="As the top-level field (vLLM's extra).")
    ignore_eos: bool | None = Field(default=None, description="As the top-level field (vLLM's extra).")
    min_tokens: int | None = Field(default=None, ge=0, description="As the top-level field (vLLM's extra).")


# vLLM's sampling extras, accepted top-level and in the ``kvbaton`` field.
_EXTRA_SAMPLING = ("top_k", "ignore_eos", "min_tokens")
_TOP_K_DOC = "vLLM's extra: sample from the k likeliest (0 or -1: off)."


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a last chunk with the usage); vLLM's
    ``continuous_usage_stats`` only at its no-op ``false``; OpenAI's ``include_obfuscation`` is
    accepted (a stream here carries no obfuscation)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None
    include_obfuscation: bool | None = None
    continuous_usage_stats: Literal[False] | None = Field(default=None, description="vLLM's extra: false only.")


class SamplingRequest(BaseModel):
    """What every OpenAI request shares. Strict, as OpenAI is: a number given as a string is a 400,
    not read as the number. Undeclared fields are checked by ``server/openai_fields`` (ignored when
    harmless, accepted at their no-op value, else 400 naming them)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    top_k: int | None = Field(default=None, ge=-1, description=_TOP_K_DOC)
    ignore_eos: bool | None = Field(default=None, description="vLLM's extra: generate past end-of-sequence.")
    min_tokens: int | None = Field(default=None, ge=0, description="vLLM's extra: no end-of-sequence or stop "
                                   "string before this many tokens.")
    kvbaton: KvbatonExtension | None = None

    @property
    def include_usage(self) -> bool:
        return False

    def choices(self) -> int:
        """Choices per prompt (``n`` where the route has it)."""
        return 1

    def first_seed(self) -> int | None:
        """The seed of choice 0 (choice ``i`` samples with ``seed + i``), where the route has one."""
        return None

    def max_field(self) -> str:
        """The field that sets the most tokens to generate, for the errors that name it."""
        return "max_tokens"

    def max_new_tokens(self) -> int | None:
        return None

    def sampling_fields(self) -> dict[str, Any]:
        """The ``SamplingParams`` fields the request sets (None: not given); vLLM's extras top-level or in
        the ``kvbaton`` field (given in both, they must agree)."""
        fields = {"max_tokens": self.max_new_tokens(), "temperature": self.temperature, "top_p": self.top_p}
        ext = self.kvbaton
        for name in _EXTRA_SAMPLING:
            top, inner = getattr(self, name), getattr(ext, name) if ext is not None else None
            if top is not None and inner is not None and top != inner:
                raise InvalidRequest(f"{name} is {top!r} but kvbaton.{name} is {inner!r}: give it once, or the same.",
                                     param=name)
            fields[name] = top if top is not None else inner
        if fields["top_k"] == -1:  # SGLang's (and older vLLM's) way to say "off"
            fields["top_k"] = 0
        return fields


class OpenAIRequest(SamplingRequest):
    """What the OpenAI chat and (legacy) completion requests share besides the sampling fields."""

    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    def choices(self) -> int:
        return self.n

    def first_seed(self) -> int | None:
        return self.seed

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_fields(self) -> dict[str, Any]:
        return {**super().sampling_fields(), "stop": self.stop}


class FunctionDefinition(BaseModel):
    """A tool's function: ``name``, ``description``, ``parameters`` (a JSON schema object)."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """An OpenAI chat tool: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(OpenAIRequest):
    """The OpenAI chat completion request."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        default=None, description="'required' or a named function is enforced by constrained decoding.")
    parallel_tool_calls: bool | None = Field(default=None, description="Accepted; an answer holds at most the "
                                             "calls the model writes (one when a call is required).")
    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object or json_schema: enforced by constrained decoding.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def max_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the tool parser take them (plain dicts)."""
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def sampling_fields(self) -> dict[str, Any]:
        return {**super().sampling_fields(), "response_format": self.response_format, "logprobs": self.logprobs,
                "top_logprobs": self.top_logprobs}


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_obfuscation: bool | None = None


class ResponsesRequest(SamplingRequest):
    """The OpenAI Responses request, text only: ``input`` (text, or message items with text content),
    ``instructions`` (a system message), ``max_output_tokens``. Fields of the chat API that the
    Responses API does not have (``n``, ``stop``, ``seed``, ``max_tokens``...) are refused, as OpenAI
    refuses them (``server/openai_fields``)."""

    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream_options: ResponsesStreamOptions | None = None

    def max_field(self) -> str:
        return "max_output_tokens"

    def max_new_tokens(self) -> int | None:
        return self.max_output_tokens


class CompletionRequest(OpenAIRequest):
    """The OpenAI (legacy) completion request: a prompt (text or token ids), or a list of them, run as
    one batch: ``n`` choices per prompt, prompt-major."""

    prompt: ContextIn | list[str] | list[list[StrictInt]]
    logprobs: int | None = Field(default=None, ge=0, le=5, description="Legacy: log probabilities of each token and "
                                 "of this many most likely alternatives.")
    echo: bool = Field(default=False, description="Each choice's text starts with its prompt (streamed: the prompt "
                       "first); not with `logprobs` (the prompt's log probabilities are not computed here).")

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one (text, or token ids), or each of a list."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if not all(prompt):
                raise InvalidRequest("Invalid value for 'prompt': a prompt of the list is empty.", param="prompt")
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    def sampling_fields(self) -> dict[str, Any]:
        legacy = self.logprobs is not None
        return {**super().sampling_fields(), "logprobs": legacy or None,
                "top_logprobs": self.logprobs if legacy else None}


# -- OpenAI answers (the shapes of the ``openai`` package's models, and kvbaton's field) -------------


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KvbatonAnswer(_Answer):
    """The ``kvbaton`` field of an OpenAI answer (the last chunks of a stream)."""

    handle: str | None = Field(description="Choice 0's result handle, when kept for the caller or retained.")
    handles: list[str | None] = Field(description="Every choice's handle kept for the caller (None: not kept).")
    agent: str | None
    step: str | int | None
    timings: list[Timings] = Field(description="One per choice.")
    exact: bool = Field(description="Whether every choice's prompt K/V equal dense prefill's.")
    token_identical: bool = Field(description="Whether exact also promises greedy output identical to dense "
                                  "prefill's (float32 only: lower precisions round differently per path).")
    reuse: Reuse = Field(description="The reuse policy the request ran with.")
    tokens_approximate: int = Field(description="Choice 0's prompt tokens whose K/V were reused approximately.")
    segments: list[SegmentReport] = Field(description="Choice 0's spans placed behind its prompt's prefix.")


class PromptTokensDetails(_Answer):
    cached_tokens: int = Field(description="Prompt tokens whose K/V were reused exactly.")


class CompletionTokensDetails(_Answer):
    reasoning_tokens: int = 0


class Usage(_Answer):
    """Each prompt counted once, every choice's completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class TopLogprobOut(_Answer):
    token: str = Field(description="The token's text; `bytes:\\xNN...` for a token that is part of a character.")
    logprob: float
    bytes: list[int] = Field(description="The token's own bytes (UTF-8 text, or the part of a character it is).")


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(_Answer):
    content: list[TokenLogprobOut] | None


class FunctionCall(_Answer):
    name: str
    arguments: str = Field(description="The arguments, as JSON text.")


class ToolCallOut(_Answer):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Answer):
    """A chat completion (OpenAI's ``ChatCompletion``, plus ``kvbaton``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: Usage
    kvbaton: KvbatonAnswer


class ToolCallDelta(_Answer):
    class Function(_Answer):
        name: str | None = None
        arguments: str | None = None

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: Function


class ChunkDelta(_Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Answer):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(_Answer):
    """One chunk of a streamed chat completion (OpenAI's ``ChatCompletionChunk``); the last ones carry
    ``kvbaton``, and with ``stream_options.include_usage`` one more, with no choices, the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChunkChoice]
    usage: Usage | None = None
    kvbaton: KvbatonAnswer | None = None


class LegacyLogprobs(_Answer):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token.")
    top_logprobs: list[dict[str, float] | None] = Field(description="null for an echoed prompt's first token.")
    text_offset: list[int]


class CompletionChoice(_Answer):
    index: int = Field(description="Prompt-major: choice `j` of prompt `i` is `i * n + j`.")
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(_Answer):
    """A (legacy) completion, whole or one streamed chunk (OpenAI's ``Completion``, plus ``kvbaton``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kvbaton: KvbatonAnswer | None = None


class OutputText(_Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(_Answer):
    type: Literal["message"]
    id: str
    status: Literal["completed"]
    role: Literal["assistant"]
    content: list[OutputText]


class InputTokensDetails(PromptTokensDetails):
    cache_write_tokens: int = Field(description="Prompt tokens prefilled for this answer (their K/V now cached).")


class ResponseUsage(_Answer):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: CompletionTokensDetails


class IncompleteDetails(_Answer):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Answer):
    """A Responses API ``response`` (OpenAI's ``Response``: text output only, plus ``kvbaton``)."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["completed", "incomplete"]
    incomplete_details: IncompleteDetails | None
    error: None
    instructions: None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    tool_choice: Literal["none"]
    tools: list[Any]
    temperature: float
    top_p: float
    output: list[OutputMessage]
    usage: ResponseUsage
    kvbaton: KvbatonAnswer


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(default=None, description="The model's context (vLLM's field).")


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]
