"""The native API of a ``kvbaton serve`` server (``/v1/kv/...``), defined once for both ends.

Each operator of :class:`~kvbaton.ops.KVOps` is one row of :data:`OPERATIONS`: its name, HTTP method,
path, request model (the JSON body, or a GET's query), answer model, and whether it streams. A row
is declared on its request model (``@operation(name, method, path, answer)``), so a body and its
route are written in one place. The HTTP clients (:mod:`kvbaton.http`) build their bodies from the
rows (:meth:`Operation.body`: the operator's arguments, bound by its signature, become a validated
request model) and read the answers with them (:meth:`Operation.read`); the server
(``kvbaton.backend.server.native``) registers one route per row with the same models. The
OpenAI-compatible bodies are the server's own (``kvbaton.backend.server.protocol``).

Invariants: a request model's fields are named for the operator's parameters, unless its ``of``
says how they map; the wire sampling fields are :class:`~kvbaton.SamplingParams` itself
(:class:`Sampling` subclasses it), so their names, defaults and limits cannot drift apart; a body
that fails validation raises the same :class:`~kvbaton.errors.InvalidRequest` on both ends
(:func:`invalid_request`); every operator but ``close`` has exactly one row.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from .capabilities import Capabilities
from .errors import InvalidRequest, validation_error
from .handle import Handle, Segment
from .ops import MAX_AGENT_CHARS, OPERATORS, KVOps, ste_map
from .types import (
    AgentInfo,
    ChatMessage,
    Composition,
    Events,
    Fidelity,
    Result,
    Reuse,
    SamplingParams,
    Stats,
)

# A handle in a request: its id, or the whole handle (then checked for compatibility with the server's model).
HandleRef = Handle | str
# Text, or token ids.
ContextIn = str | list[StrictInt]

Agent = Annotated[
    str, Field(min_length=1, max_length=MAX_AGENT_CHARS, description="Agent tag (or header X-Kvbaton-Agent).")
]


def invalid_request(errors: Iterable[Mapping[str, Any]]) -> InvalidRequest:
    """The error of a body that fails validation (pydantic's ``errors()``), as both ends word it: one
    sentence naming the field (:func:`kvbaton.errors.validation_error`)."""
    return validation_error([dict(e) for e in errors])


def plain(value: Any) -> Any:
    """An argument as JSON takes it: chat messages as dicts, any sequence (token ids, handles,
    messages) as a list, integer-likes (numpy's) as ints; handles stay handles (the model dumps them)."""
    if isinstance(value, bytes | bytearray):
        raise InvalidRequest(f"expected text or a sequence, got {type(value).__name__}")
    if isinstance(value, ChatMessage):
        return value.model_dump(exclude_none=True)
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str | int | float | BaseModel):
        return value
    if isinstance(value, Iterable):
        return [plain(v) for v in value]
    try:
        return operator.index(value)  # a numpy integer, say
    except TypeError:
        return value  # validation says what is wrong with it


def _given(arguments: Mapping[str, Any], but: str = "") -> dict[str, Any]:
    """The arguments given (not None), as JSON takes them."""
    return {name: plain(value) for name, value in arguments.items() if value is not None and name != but}


class Request(BaseModel):
    """A request body, built from an operator's bound arguments by :meth:`of`."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        """The body of a call: each argument given (not None) in the field of its name."""
        return cls.validated(_given(arguments))

    @classmethod
    def validated(cls, fields: Mapping[str, Any]) -> Self:
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise invalid_request(exc.errors()) from None


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


class Generation(Sampling, Request):
    """A generating request: its ``sampling`` argument flat in the body."""

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        sampling = arguments["sampling"] if arguments["sampling"] is not None else SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequest(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        return cls.validated({**sampling.model_dump(mode="json"), **_given(arguments, but="sampling")})


# -- answers ----------------------------------------------------------------------------------------


class Answer(BaseModel):
    """An operator's value as the one field of a JSON object (so the answer can grow fields later)."""

    @classmethod
    def wrap(cls, value: Any) -> Self:
        (field,) = cls.model_fields
        return cls.model_validate({field: value})

    def unwrap(self) -> Any:
        """The operator's value."""
        (field,) = type(self).model_fields
        return getattr(self, field)


class ForkResponse(Answer):
    handles: list[Handle]


class ReleaseResponse(Answer):
    released: int

    def unwrap(self) -> None:
        return None  # release answers nothing; the count is for callers of the HTTP API


class TokenIds(Answer):
    token_ids: list[int]


class Text(Answer):
    text: str


class AgentInfoOut(Answer):
    name: str
    fixed_tokens: int

    def unwrap(self) -> AgentInfo:
        return AgentInfo(name=self.name, fixed_tokens=self.fixed_tokens)


class AgentUnregistered(Answer):
    unregistered: bool


class HintsResponse(Answer):
    steps: dict[str, float]


# -- the table --------------------------------------------------------------------------------------


@functools.cache
def _signature(name: str) -> inspect.Signature:
    return inspect.signature(getattr(KVOps, name))


@dataclass(frozen=True)
class Operation:
    """One operator on the wire: ``method path`` with a ``request`` body (a GET's or a DELETE's: its
    query; None: no arguments) answered by ``answer``; a streaming operator answers the same request, with
    ``stream: true``, by server-sent events ending in its ``answer``."""

    name: str
    method: Literal["GET", "POST", "DELETE"]
    path: str
    request: type[Request] | None
    answer: type[BaseModel]
    stream: bool = False
    idempotent: bool = False  # the same call twice leaves what once does: the HTTP clients may retry it

    def body(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        """The JSON body (a GET's query) of the call ``operator(*args, **kwargs)``; a call the
        operator's signature refuses raises TypeError, a body the model refuses InvalidRequest."""
        bound = _signature(self.name).bind(None, *args, **kwargs)  # None: the operator's self
        bound.apply_defaults()
        arguments = dict(list(bound.arguments.items())[1:])
        if self.request is None:
            return None
        request = self.request.of(arguments)
        body = request.model_dump(mode="json", include=request.model_fields_set)  # the arguments given, whole
        return {**body, "stream": True} if self.stream else body

    def read(self, answer: Any) -> Any:
        """The operator's value from the JSON answer."""
        out = self.answer.model_validate(answer)
        return out.unwrap() if isinstance(out, Answer) else out


OPERATIONS: dict[str, Operation] = {}
"""Every operator of :class:`~kvbaton.ops.KVOps` by name (``close`` aside: it is local), each
declared below with its request model (:func:`operation`)."""

R = TypeVar("R", bound=Request)


def operation(
    name: str, method: Literal["GET", "POST", "DELETE"], path: str, answer: type[BaseModel], *,
    stream: str | None = None, idempotent: bool = False,
) -> Callable[[type[R]], type[R]]:
    """Declare the operator ``name`` on the wire: ``method path``, the decorated model its request,
    ``answer`` its answer; ``stream`` names its streaming twin (the same route, ``stream: true``);
    ``idempotent``: the same call twice leaves what once does (reads, releases, registrations), so
    the HTTP clients retry it on a transient 503. An operator that makes handles is not: a retried
    call whose first answer was lost would make them twice."""

    def declare(request: type[R]) -> type[R]:
        _declare(Operation(name, method, path, request, answer, idempotent=idempotent))
        if stream is not None:
            _declare(Operation(stream, method, path, request, answer, stream=True))
        return request

    return declare


def _declare(row: Operation) -> None:
    if row.name in OPERATIONS or row.name not in OPERATORS:
        raise ValueError(f"{row.name!r} is declared twice or is no operator of KVOps")
    OPERATIONS[row.name] = row


# -- requests ---------------------------------------------------------------------------------------


@operation("materialize", "POST", "/v1/kv/materialize", Handle)
class MaterializeRequest(Request):
    context: ContextIn
    agent: Agent | None = None


@operation("extend", "POST", "/v1/kv/extend", Handle)
class ExtendRequest(Request):
    handle: HandleRef
    context: ContextIn
    agent: Agent | None = None


@operation("fork", "POST", "/v1/kv/fork", ForkResponse)
class ForkRequest(Request):
    handle: HandleRef
    k: StrictInt = 2


@operation("transfer", "POST", "/v1/kv/transfer", Handle, idempotent=True)
class TransferRequest(Request):
    handle: HandleRef
    device: StrictInt | str = Field(description="Target worker: its rank, or its device name when that is unique (e.g. 'cuda:1').")


class SegmentIn(BaseModel):
    """Tokens ``start..end-1`` of a handle, to splice into a composed prompt."""

    model_config = ConfigDict(extra="forbid")
    handle: HandleRef
    start: StrictInt = Field(default=0, ge=0)
    end: StrictInt | None = Field(default=None, ge=1)
    slot: str | None = Field(default=None, min_length=1, max_length=256)


def _segments(parts: Sequence[Segment | Handle]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, Handle):
            out.append({"handle": part})
        elif isinstance(part, Segment):
            out.append({"handle": part.handle, "start": part.start, "end": part.end, "slot": part.slot})
        else:
            raise InvalidRequest(f"segments must be Segment or Handle objects, got {type(part).__name__}")
    return out


@operation("compose", "POST", "/v1/kv/compose", Composition)
class ComposeRequest(Request):
    prefix_handle: HandleRef | None = Field(default=None, description="A handle whose K/V start the prompt.")
    prefix: ContextIn | None = Field(default=None, description="Text or token ids starting the prompt.")
    segments: list[SegmentIn] = Field(default_factory=list, max_length=256)
    suffix: ContextIn | None = None
    agent: Agent | None = None
    mode: Literal["auto", "rotate", "dense"] = "auto"
    correction: dict[str, Any] | None = Field(default=None, description="Anchor-pool settings for this call.")

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        prefix = arguments["prefix"]
        fields = {**arguments, "segments": _segments(arguments["segments"]), "prefix": None}
        fields["prefix_handle" if isinstance(prefix, Handle) else "prefix"] = prefix
        return super().of(fields)


@operation("merge", "POST", "/v1/kv/merge", Composition)
class MergeRequest(Request):
    parts: list[SegmentIn] = Field(min_length=1, max_length=256, description="Whole handles (no start/end/slot) "
                                   "merge when prefix-compatible; segments are concatenated.")
    agent: Agent | None = None
    mode: Literal["auto", "rotate", "dense"] = "auto"
    correction: dict[str, Any] | None = None

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        return super().of({**arguments, "parts": _segments(arguments["parts"])})


@operation("fidelity", "POST", "/v1/kv/fidelity", Fidelity, idempotent=True)
class FidelityRequest(Request):
    handle: HandleRef
    max_tokens: StrictInt = Field(default=32, ge=1, le=4096)
    reference: HandleRef | None = None


@operation("resume", "POST", "/v1/kv/resume", Result, stream="resume_stream")
class ResumeRequest(Generation):
    handle: HandleRef
    suffix: ContextIn = ""
    agent: Agent | None = None


ReuseField = Field(
    default=None,
    description="Reuse policy (or header X-Kvbaton-Reuse): 'exact' (no approximate K/V; in float32 greedy output "
    "identical to dense prefill), 'auto', 'rotate' or 'correct' (also spans other agents computed behind another "
    "prefix, approximately; the result's `exact` and `segments` say so). Default: the server's (--reuse, 'exact' "
    "unless set).",
)


@operation("complete", "POST", "/v1/kv/complete", Result, stream="complete_stream")
class CompleteRequest(Generation):
    prompt: ContextIn
    agent: Agent | None = None
    reuse: Reuse | None = ReuseField


@operation("generate", "POST", "/v1/kv/generate", Result, stream="generate_stream")
class GenerateRequest(Generation):
    messages: list[dict[str, Any]]
    handle: HandleRef | None = None
    tools: list[dict[str, Any]] | None = None
    agent: Agent | None = None
    reuse: Reuse | None = ReuseField


@operation("release", "POST", "/v1/kv/release", ReleaseResponse, idempotent=True)
class ReleaseRequest(Request):
    handles: list[HandleRef] = Field(min_length=1)

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        handles = arguments["handles"]
        return super().of({"handles": [handles] if isinstance(handles, Handle | str) else handles})


@operation("events", "GET", "/v1/kv/events", Events, idempotent=True)
class EventsQuery(Request):
    """The query of ``GET /v1/kv/events`` (undeclared parameters are ignored, as on any GET)."""

    model_config = ConfigDict(extra="ignore")
    since: int = Field(default=0, ge=0)

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        since = arguments["since"]
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise InvalidRequest(f"since must be an integer >= 0, got {since!r}")
        return super().of(arguments)


@operation("tokenize", "POST", "/v1/kv/tokenize", TokenIds, idempotent=True)
class TokenizeRequest(Request):
    text: str


@operation("detokenize", "POST", "/v1/kv/detokenize", Text, idempotent=True)
class DetokenizeRequest(Request):
    token_ids: list[StrictInt]


@operation("chat_tokens", "POST", "/v1/kv/chat_tokens", TokenIds, idempotent=True)
class ChatTokensRequest(Request):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


@operation("register_agent", "POST", "/v1/kv/agents", AgentInfoOut, idempotent=True)
class RegisterAgentRequest(Request):
    name: Agent
    fixed_prompt: ContextIn | list[dict[str, Any]] = Field(
        description="Text, token ids, or chat messages (rendered without the generation prompt)."
    )
    prefill: bool = False


@operation("unregister_agent", "DELETE", "/v1/kv/agents", AgentUnregistered, idempotent=True)
class UnregisterAgentRequest(Request):
    """The query of ``DELETE /v1/kv/agents?name=...`` (undeclared parameters are ignored, as on a GET)."""

    model_config = ConfigDict(extra="ignore")
    name: Agent


@operation("hints", "POST", "/v1/kv/hints", HintsResponse, idempotent=True)
class HintsRequest(Request):
    steps: dict[Agent, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description="Steps until each agent runs next."
    )
    running: list[Agent] = Field(default_factory=list, description="Agents running now (steps 0).")

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        # The STE map already holds the running agents (0); JSON has no infinity: an agent missing
        # from the map counts as never running.
        steps = ste_map(arguments["steps"], arguments["running"], arguments["finished"])
        return super().of({"steps": {agent: v for agent, v in steps.items() if v != math.inf}})


# Operators without arguments: a GET of the route alone.
_declare(Operation("stats", "GET", "/v1/kv/stats", None, Stats, idempotent=True))
_declare(Operation("capabilities", "GET", "/v1/capabilities", None, Capabilities, idempotent=True))
