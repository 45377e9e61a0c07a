"""The one operator contract of kvbaton: :class:`KVOps`.

Every backend implements it with the same signatures: the in-process
:class:`~kvbaton.backend.Engine`, the multi-device :class:`~kvbaton.backend.cluster.Cluster`, the
SGLang engine of the plugin, and the HTTP operations of a ``kvbaton serve`` server
(:class:`~kvbaton.http.HttpOps`). :class:`~kvbaton.Client` and :class:`~kvbaton.AsyncClient` are
written once over any of them (the way LangGraph's ``PregelProtocol`` is implemented by both the
local graph and ``RemoteGraph``).

Sampling arrives here as :class:`~kvbaton.SamplingParams` (the clients turn keyword options into
one); steps-to-execution hints as a mapping or a :class:`~kvbaton.StepGraph`, turned into an STE map
by :func:`ste_map` — the one place that conversion and its validation live.

Adding an operator: declare it here, implement it in the engine module that owns the concept, add
it to the HTTP operation table and the server route; ``Client``/``AsyncClient`` get a typed line each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .errors import InvalidRequest
from .handle import Handle, Segment

if TYPE_CHECKING:
    from .capabilities import Capabilities
    from .stepgraph import StepGraph
    from .stream import TokenStream
    from .types import AgentInfo, ChatMessage, Composition, Events, Fidelity, Result, Reuse, SamplingParams, Stats

HandleLike = Handle | str
Context = str | Sequence[int]
Messages = Sequence["ChatMessage | dict[str, Any]"]

MAX_AGENT_CHARS = 256


@runtime_checkable
class KVOps(Protocol):
    """The handle operators on one model (see docs/sdk.md for each one's semantics)."""

    def materialize(self, context: Context, *, agent: str | None = None) -> Handle: ...

    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]: ...

    def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle: ...

    def resume(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None,
        *, agent: str | None = None,
    ) -> Result: ...

    def resume_stream(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None,
        *, agent: str | None = None,
    ) -> TokenStream: ...

    def complete(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None,
    ) -> Result: ...

    def complete_stream(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None,
    ) -> TokenStream: ...

    def generate(
        self, messages: Messages, *, handle: HandleLike | None = None, sampling: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None, agent: str | None = None, reuse: Reuse | None = None,
    ) -> Result: ...

    def generate_stream(
        self, messages: Messages, *, handle: HandleLike | None = None, sampling: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None, agent: str | None = None, reuse: Reuse | None = None,
    ) -> TokenStream: ...

    def compose(
        self, prefix: Handle | Context | None = None, segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None, *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition: ...

    def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition: ...

    def fidelity(self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None) -> Fidelity: ...

    def transfer(self, handle: HandleLike, device: int | str) -> Handle: ...

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None: ...

    def stats(self) -> Stats: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def chat_tokens(
        self, messages: Messages, *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> list[int]: ...

    def register_agent(self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False) -> AgentInfo: ...

    def hints(
        self, steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]: ...

    def capabilities(self) -> Capabilities: ...

    def events(self, since: int = 0) -> Events: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineOps(KVOps, Protocol):
    """What a server needs beyond :class:`KVOps` of an engine it hosts in its own process."""

    def describe(self, handle: HandleLike) -> Handle:
        """The current metadata (lineage included) of a live handle."""
        ...

    @property
    def max_context(self) -> int | None:
        """The model's context length in tokens, when it says."""
        ...

    def healthy(self) -> tuple[bool, str]:
        """Whether the engine can serve requests now, and a short reason (a server's ``/health``)."""
        ...


# The operators by name, e.g. for a worker's whitelist of methods its coordinator may call.
OPERATORS: frozenset[str] = frozenset(
    name for name in vars(KVOps) if not name.startswith("_") and callable(getattr(KVOps, name))
) - {"close"}
STREAM_OPERATORS: frozenset[str] = frozenset(name for name in OPERATORS if name.endswith("_stream"))


def check_reuse(reuse: str | None) -> None:
    """A reuse policy is ``None`` (the engine's default) or one of :data:`kvbaton.types.REUSE_POLICIES`."""
    from .types import REUSE_POLICIES

    if reuse is not None and reuse not in REUSE_POLICIES:
        raise InvalidRequest(f"reuse must be one of {', '.join(map(repr, REUSE_POLICIES))}, got {reuse!r}")


def check_agent(agent: str | None) -> None:
    """An agent tag is a non-empty string of at most :data:`MAX_AGENT_CHARS` characters."""
    if agent is not None and (not isinstance(agent, str) or not agent or len(agent) > MAX_AGENT_CHARS):
        raise InvalidRequest(f"agent must be a non-empty string of at most {MAX_AGENT_CHARS} characters")


def ste_map(
    steps: Mapping[str, float] | StepGraph | Any, running: Iterable[str] = (), finished: Iterable[str] = ()
) -> dict[str, float]:
    """Steps-to-execution as a validated ``{agent: steps}`` map: a step graph (anything with
    ``steps_to_execution(running=, finished=)``) is evaluated; a mapping is copied with the
    ``running`` agents set to 0. Values are numbers >= 0 (``inf``: not due this round)."""
    running, finished = _names(running), _names(finished)
    if hasattr(steps, "steps_to_execution"):
        out = dict(steps.steps_to_execution(running=running, finished=finished))
    elif isinstance(steps, Mapping):
        out = dict(steps.items())
        for agent in running:
            out[agent] = 0
    else:
        raise InvalidRequest("hints need a {agent: steps} mapping or a StepGraph")
    for agent, value in out.items():
        if not isinstance(agent, str):
            raise InvalidRequest(f"agent names must be strings, got {type(agent).__name__}")
        check_agent(agent)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < 0:
            raise InvalidRequest(f"steps-to-execution of {agent!r} must be a number >= 0, got {value!r}")
    return {agent: float(value) for agent, value in out.items()}


def _names(agents: Iterable[str]) -> tuple[str, ...]:
    if isinstance(agents, str):  # one agent name, not its characters
        return (agents,)
    return tuple(agents)
