"""The one operator contract of kvbaton: :class:`KVOps`, and :class:`AsyncKVOps`, the same with coroutines.

Every backend implements it with the same signatures: the in-process
:class:`~kvbaton.backend.Engine`, the multi-device :class:`~kvbaton.backend.cluster.Cluster`, the
SGLang engine of the plugin, and the HTTP operations of a ``kvbaton serve`` server
(:class:`~kvbaton.http.HttpOps`). :class:`~kvbaton.Client` and :class:`~kvbaton.AsyncClient` are
written over them (the way LangGraph's ``PregelProtocol`` is implemented by both the local graph
and ``RemoteGraph``); :class:`~kvbaton.threaded.ThreadedOps` (any blocking backend in worker
threads) and :class:`~kvbaton.http.AsyncHttpOps` implement :class:`AsyncKVOps`.

Sampling arrives here as :class:`~kvbaton.SamplingParams` (the clients turn keyword options into
one); steps-to-execution hints as a mapping or a :class:`~kvbaton.StepGraph`, turned into an STE map
by :func:`ste_map` — the one place that conversion and its validation live.

Adding an operator `foo` takes seven edits in six files when the clients pass it through
unchanged and the server's generic route serves it (it names no handle and no agent):

1. `sdk/ops.py`: declare `foo` in `KVOps` (its docstring says what it does) and, awaited, in
   `AsyncKVOps` (two edits).
2. `sdk/wire.py`: its request model, fields named for its parameters, declared on the wire by
   `@operation("foo", "POST", "/v1/kv/foo", answer)` right above it (an `Answer` model wraps a
   value that is no JSON object).
3. `sdk/client.py`: `foo = _Forward(KVOps.foo)` in `BaseClient`. An operator that makes handles
   or takes sampling options gets a typed method in `Client` and in `AsyncClient` instead.
4. Implement it in `Engine` (`backend/engine.py`, delegating to the module that owns the concept),
   `Cluster` (`backend/cluster/coordinator.py`) and `SglangEngine`
   (`backend/sglang_plugin/engine.py`) (three edits).
5. Only if it names handles or agents: its policy in `backend/server/native.py`, a function
   named `foo` (tenant ownership, quotas, agent names); the generic route refuses such an operator.

The rest follows from the contract and the table: `ThreadedOps`, `HttpOps` / `AsyncHttpOps`, the
server's route and OpenAPI schema, the cluster worker's whitelist. Regenerate `docs/api.md`
(`python -m kvbaton.backend.server.apidoc docs/api.md`); `tests/test_ops_contract_static.py` and
`tests/test_wire.py` check that the declarations agree, and `tests/test_contract.py` holds every
backend to the cases you add for `foo`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, runtime_checkable

from .errors import InvalidRequest
from .handle import Handle, HandleLike, Segment

if TYPE_CHECKING:
    from .capabilities import Capabilities
    from .stepgraph import StepGraph
    from .stream import AsyncTokenStream, TokenStream
    from .types import AgentInfo, ChatMessage, Composition, Events, Fidelity, Result, Reuse, SamplingParams, Stats

Context = str | Sequence[int]
Messages = Sequence["ChatMessage | dict[str, Any]"]

MAX_AGENT_CHARS = 200
"""The longest agent tag: the wire's request models (:mod:`kvbaton.wire`) and every engine's
:func:`check_agent` hold it, so an agent the SDK accepts is one every backend accepts."""


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

    def fidelity(self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None) -> Fidelity:
        """Measure a (composed) handle against dense prefill of its tokens: first-token agreement,
        greedy agreement over ``max_tokens`` tokens and mean KL of the next-token distribution."""
        ...

    def transfer(self, handle: HandleLike, device: int | str) -> Handle: ...

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None: ...

    def stats(self) -> Stats:
        """Pool usage and reuse counters."""
        ...

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``."""
        ...

    def chat_tokens(
        self, messages: Messages, *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """``messages`` rendered by the model's chat template, as token ids. Without the generation
        prompt they are a prefix of any longer conversation: materialize shared context that way."""
        ...

    def register_agent(self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False) -> AgentInfo:
        """Declare an agent's fixed prompt (text, token ids or chat messages) for workflow-aware
        caching: its cached KV takes the agent's steps-to-execution. ``prefill`` computes it now."""
        ...

    def unregister_agent(self, name: str) -> bool:
        """Forget an agent's registration (its fixed prompt, kept on the host until now); its requests
        run as before. Whether the agent was registered."""
        ...

    def hints(
        self, steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        """Tell the backend how many steps until each agent runs (a mapping, or a step graph with
        the agents running and finished now); agents due soon are prefetched. Returns the STE map."""
        ...

    def capabilities(self) -> Capabilities:
        """What the engine behind this client does exactly, corrects, recomputes or cannot do."""
        ...

    def events(self, since: int = 0) -> Events:
        """What the engine did after event ``since`` (0: everything it still holds): one ``request``
        event per request with its phase times and token sources, and the cache's evictions and
        prefetches; pass the answer's ``next`` to read on (docs/dashboard.md)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncKVOps(Protocol):
    """:class:`KVOps` with coroutines: the same operators, parameters and answers, awaited; a
    streaming operator answers an :class:`~kvbaton.stream.AsyncTokenStream`. Implemented by
    :class:`~kvbaton.threaded.ThreadedOps` (any blocking backend, in worker threads) and
    :class:`~kvbaton.http.AsyncHttpOps`; :class:`~kvbaton.AsyncClient` is written over it."""

    async def materialize(self, context: Context, *, agent: str | None = None) -> Handle: ...

    async def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]: ...

    async def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle: ...

    async def resume(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None,
        *, agent: str | None = None,
    ) -> Result: ...

    async def resume_stream(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None,
        *, agent: str | None = None,
    ) -> AsyncTokenStream: ...

    async def complete(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None,
    ) -> Result: ...

    async def complete_stream(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None,
    ) -> AsyncTokenStream: ...

    async def generate(
        self, messages: Messages, *, handle: HandleLike | None = None, sampling: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None, agent: str | None = None, reuse: Reuse | None = None,
    ) -> Result: ...

    async def generate_stream(
        self, messages: Messages, *, handle: HandleLike | None = None, sampling: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None, agent: str | None = None, reuse: Reuse | None = None,
    ) -> AsyncTokenStream: ...

    async def compose(
        self, prefix: Handle | Context | None = None, segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None, *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition: ...

    async def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition: ...

    async def fidelity(
        self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None
    ) -> Fidelity: ...

    async def transfer(self, handle: HandleLike, device: int | str) -> Handle: ...

    async def release(self, handles: HandleLike | Iterable[HandleLike]) -> None: ...

    async def stats(self) -> Stats: ...

    async def tokenize(self, text: str) -> list[int]: ...

    async def detokenize(self, token_ids: Sequence[int]) -> str: ...

    async def chat_tokens(
        self, messages: Messages, *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> list[int]: ...

    async def register_agent(
        self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False
    ) -> AgentInfo: ...

    async def unregister_agent(self, name: str) -> bool: ...

    async def hints(
        self, steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]: ...

    async def capabilities(self) -> Capabilities: ...

    async def events(self, since: int = 0) -> Events: ...

    async def close(self) -> None: ...


def is_async(ops: KVOps | AsyncKVOps) -> TypeGuard[AsyncKVOps]:
    """Whether ``ops`` is the contract with coroutines (its operators are coroutine functions)."""
    return inspect.iscoroutinefunction(ops.release)


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
        """Whether the engine can serve requests now, and a short reason (a server's ``/health``):
        ``(True, "ok")`` serving fully, ``(True, why)`` serving degraded (a cluster worker down),
        ``(False, why)`` not serving."""
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
