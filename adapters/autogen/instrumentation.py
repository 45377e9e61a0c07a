"""``instrument``: kvbaton under an AutoGen agent or team, in place, and what it attaches.

:func:`instrument` puts each participant's model client on kvbaton (decided per client by
:mod:`.plan`), registers each agent's system message as its fixed prompt, extracts the team's step
graph (:mod:`.graph`) and patches the agents and the team: before every turn the
:class:`Instrumentation` (``obj.kvbaton``) sends steps-to-execution hints
(:class:`kvbaton.adapters.core.HintSender`), each reply is stamped with its handle, every ``run`` /
``run_stream`` is an ownership scope (:mod:`kvbaton.adapters.ownership`), and ``dump_component``
dumps an :class:`Instrumented` component that loads the original back and instruments it again.
``@agent`` does the same for an AssistantAgent factory.

Invariants: instrumenting twice patches once (the originals are kept); hints never break a turn;
nothing on kvbaton at all is an error (:class:`~kvbaton.errors.InvalidRequest`), never a silent no-op.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, TypeVar

from autogen_agentchat.base import Response
from autogen_agentchat.messages import BaseChatMessage
from autogen_core import Component, ComponentBase, ComponentLoader, ComponentModel
from kvbaton.client import AsyncClient, Client
from kvbaton.errors import InvalidRequest
from kvbaton.scope import check_session
from kvbaton.stepgraph import StepGraph
from pydantic import BaseModel, Field

from ..connections import target_of
from ..core import HintSender, reuse_report
from ..ownership import aend_run, run_scope
from .client import METADATA_KEY, KvbatonChatCompletionClient
from .graph import extract_step_graph, participants_of
from .handle_table import HandleTable, handle_table
from .plan import plan, resolve_client

logger = logging.getLogger("kvbaton.adapters.autogen")

T = TypeVar("T")

SELECTOR_AGENT_SUFFIX = ".selector"
EXACT_KEY = "kvbaton_exact"
"""``metadata`` key of a stamped reply: ``"false"`` when part of its prompt K/V was reused approximately."""
APPROXIMATE_KEY = "kvbaton_tokens_approximate"
"""``metadata`` key of a stamped reply: prompt tokens whose K/V were reused approximately (a decimal string)."""


# -- run time ---------------------------------------------------------------------------------------


@dataclass
class HintEvent:
    """One hints call: who was running, who had finished, and the STE sent."""

    running: tuple[str, ...]
    finished: tuple[str, ...]
    steps: dict[str, float]


@dataclass
class _Completion:
    """A finished turn, until the turns it enables have started.

    Its plain successors (edges, joins) each consume it by starting; a router consumes it as soon as
    one of its targets starts (one of them runs). Once consumed it no longer counts as finished, so a
    later round (a loop) waits for it again instead of seeing a stale completion."""

    pending: set[str]
    router: bool
    targets: tuple[str, ...] | None

    def consumed_by(self, agent: str) -> bool:
        self.pending.discard(agent)
        if self.router and (self.targets is None or agent in self.targets):
            self.router = False
        return not self.pending and not self.router


@dataclass
class Instrumentation:
    """What :func:`instrument` attached to an agent or team (``obj.kvbaton``)."""

    step_graph: StepGraph
    client: Client | AsyncClient
    model_clients: dict[str, KvbatonChatCompletionClient] = field(default_factory=dict)
    hint_log: list[HintEvent] = field(default_factory=list)
    speakers: list[str] = field(default_factory=list)
    send_hints: InitVar[bool] = True
    running: dict[str, int] = field(default_factory=dict)
    finished: dict[str, _Completion] = field(default_factory=dict)
    hint_sender: HintSender = field(init=False, repr=False)
    runs: int = 0
    """Runs in progress (``team.run`` runs ``team.run_stream``: only the outermost ends the scope)."""
    changes: list[str] = field(default_factory=list)
    """What :func:`instrument` changed or left alone, one line per model client (also logged)."""
    session: str | None = None
    """The reuse session every run shares (``instrument(session=...)``: reuse across runs, on purpose); None:
    each conversation is its own (:attr:`conversation`)."""
    conversation: str = field(default_factory=lambda: uuid.uuid4().hex)
    """The current conversation's reuse session: new at ``instrument()`` and at every ``reset()``."""

    @property
    def reuse_session(self) -> str:
        """The reuse session of the team's runs now (:mod:`kvbaton.scope`)."""
        return self.session if self.session is not None else self.conversation

    def __post_init__(self, send_hints: bool) -> None:
        # False: hints are only logged; a client without hints() turns it off by itself
        self.hint_sender = HintSender(self.step_graph, self.client, enabled=send_hints, logger=logger)

    @property
    def handle_table(self) -> HandleTable:
        return handle_table(self.client)

    async def turn_started(self, agent: str) -> None:
        """An agent starts a turn: it is running, the completions it consumes stop counting as
        finished, and hints go out."""
        self.speakers.append(agent)
        self.running[agent] = self.running.get(agent, 0) + 1
        if agent not in self.step_graph.agents:
            return
        self.finished.pop(agent, None)
        for name, completion in list(self.finished.items()):
            if completion.consumed_by(agent):
                del self.finished[name]
        await self._hint()

    def turn_finished(self, agent: str) -> None:
        count = self.running.get(agent, 0) - 1
        if count <= 0:
            self.running.pop(agent, None)
        else:
            self.running[agent] = count
        if agent in self.step_graph.agents:
            graph = self.step_graph
            routers = graph.routers
            self.finished[agent] = _Completion(pending=set(graph.successors(agent)), router=agent in routers,
                                               targets=routers.get(agent))

    async def release_all(self) -> int:
        """Release every handle the model clients created (the conversation starts over). Never raises."""
        released = 0
        for model_client in self.model_clients.values():
            try:
                released += await model_client.release_owned_handles()
            except Exception as exc:  # noqa: BLE001 - cleanup never breaks the app's reset
                logger.warning("kvbaton: releasing the handles of %s failed: %s", model_client.agent, exc)
        return released

    async def run_finished(self, run: Any) -> None:
        """A run ended: the model clients keep only their latest reply's handle; what else the run
        created (``run``, a contextual scope) is released. Never raises."""
        for model_client in self.model_clients.values():
            run.forget(model_client.owned_handles)  # theirs to release, below
            await model_client.release_run_handles()
        await aend_run(run, None, set())

    def reset(self) -> None:
        """Forget run-time state (a new run of the team); the next conversation is a new reuse session."""
        self.running.clear()
        self.finished.clear()
        self.conversation = uuid.uuid4().hex

    async def _hint(self) -> None:
        known = set(self.step_graph.agents)
        running = tuple(a for a in self.running if a in known)
        finished = tuple(a for a in self.finished if a not in self.running)
        steps = self.step_graph.steps_to_execution(running=running, finished=finished)
        self.hint_log.append(HintEvent(running, finished, {a: float(v) for a, v in steps.items()}))
        await self.hint_sender.asend(running, finished)


def _wrap_turns(agent: Any, inst: Instrumentation) -> None:
    """Patch the agent instance's ``on_messages_stream``: turn start/finish and handle stamping."""
    if getattr(agent, "_kvbaton_wrapped", None) is inst:
        return
    original = getattr(agent, "_kvbaton_original_stream", None) or agent.on_messages_stream
    name = agent.name

    async def on_messages_stream(messages: Sequence[BaseChatMessage], cancellation_token: Any) -> AsyncGenerator[Any, None]:
        await inst.turn_started(name)
        model_client = inst.model_clients.get(name)
        before = model_client.last_handle if model_client is not None else None
        try:
            async for item in original(messages, cancellation_token):
                if isinstance(item, Response):
                    handle = model_client.last_handle if model_client is not None else None
                    if handle is not None and handle is not before:
                        assert model_client is not None
                        stamp(item.chat_message, handle.id, model_client.last_result)
                yield item
        finally:
            inst.turn_finished(name)

    agent.on_messages_stream = on_messages_stream
    agent._kvbaton_original_stream = original
    agent._kvbaton_wrapped = inst


def stamp(message: BaseChatMessage, handle_id: str, result: Any = None) -> None:
    """Set ``message.metadata["kvbaton_handle"]`` and, given the reply's kvbaton ``Result``,
    ``kvbaton_exact`` (``"true"``/``"false"``) and ``kvbaton_tokens_approximate`` (metadata values are strings)."""
    try:
        message.metadata[METADATA_KEY] = handle_id
        if result is not None:
            report = reuse_report(result)
            message.metadata[EXACT_KEY] = "true" if report["exact"] else "false"
            message.metadata[APPROXIMATE_KEY] = str(report["tokens_approximate"])
    except Exception:  # a frozen or foreign message type: metadata is best effort
        logger.debug("could not stamp %r", message, exc_info=True)


def instrument(
    agent_or_team: T,
    client: Client | AsyncClient | str | None = None,
    *,
    prefill: bool = False,
    hints: bool = True,
    session: str | None = None,
    **client_options: Any,
) -> T:
    """Put kvbaton under an AutoGen agent or team, in place; returns it.

    - each participant with a ``_model_client`` (``AssistantAgent``) runs on kvbaton, tagged with its
      name. Without ``client``, the user's model clients are kept where they run: a
      :class:`KvbatonChatCompletionClient` keeps its engine and settings, an
      ``OpenAIChatCompletionClient`` pointed at a ``kvbaton serve`` server becomes a kvbaton client
      on that server with the same ``max_tokens``/``temperature``/``top_p``/``seed``/``stop``, and any
      other client is left as it is. With ``client`` (a kvbaton client or a server URL) every model
      client moves there, its settings carried over. ``client_options`` (``max_tokens=64``...)
      override the settings. Each decision is logged and listed in ``obj.kvbaton.changes``; when no
      model client ends up on kvbaton, :class:`~kvbaton.errors.InvalidRequest` says to pass ``client``;
    - the agent's system message is registered as its fixed prompt (``prefill=True`` computes it
      into the prefix cache now);
    - a ``SelectorGroupChat``'s own model client follows the same rules (tagged ``<team name>.selector``);
    - the step graph is extracted (``obj.step_graph``; run-time state in ``obj.kvbaton``, an
      :class:`Instrumentation`), and before each turn ``client.hints(step_graph, running, finished)``
      is sent;
    - replies are stamped with ``metadata["kvbaton_handle"]``, ``"kvbaton_exact"`` and
      ``"kvbaton_tokens_approximate"``;
    - every ``run`` / ``run_stream`` is an ownership scope and runs in the conversation's reuse session: its
      requests place only spans the same conversation computed (from ``instrument()`` or the last
      ``reset()`` on), so a new team's (or a reset team's) first agent never answers from an earlier run's
      K/V; ``session="name"`` makes every run that session (reuse across runs, on purpose);
      ``team.reset()`` (a single agent's
      ``on_reset``) releases every handle the model clients hold, and closing a model client the app
      built (``await model_client.close()``) closes the kvbaton clients that replaced it;
    - ``obj.dump_component()`` dumps an :class:`Instrumented` component: ``load_component`` of it
      returns the object instrumented again (same options; an ``"embedded"`` client attaches to the
      process's shared connection, see :func:`register_connection`).
    """
    given = resolve_client(client)
    obj: Any = agent_or_team
    participants = participants_of(obj)
    members = participants if participants else [obj]
    plans: list[tuple[Any, str, Any, KvbatonChatCompletionClient | None]] = []
    changes: list[str] = []
    for member in members:
        if hasattr(member, "_model_client"):
            model_client, line = plan(member._model_client, given, member.name, client_options)
            plans.append((member, member.name, member._model_client, model_client))
            changes.append(line)
    selector = None
    if participants and getattr(obj, "_model_client", None) is not None:  # SelectorGroupChat
        selector = f"{obj.name}{SELECTOR_AGENT_SUFFIX}"
        # its system prompt embeds the conversation and changes every turn: no fixed prompt to register
        model_client, line = plan(obj._model_client, given, selector, {**client_options, "register_prompt": False})
        plans.append((obj, selector, obj._model_client, model_client))
        changes.append(line)
    on_kvbaton = [m for *_, m in plans if m is not None]
    backend = given if given is not None else on_kvbaton[0].kvbaton_client if on_kvbaton else None
    if backend is None:
        raise InvalidRequest(
            f"instrument(): no model client of {getattr(obj, 'name', type(obj).__name__)!r} runs on kvbaton "
            f"({'; '.join(changes) or 'no model clients'}): pass client=<kvbaton client or kvbaton serve URL> to "
            "replace them"
        )
    graph = extract_step_graph(obj)
    inst = Instrumentation(step_graph=graph, client=backend, send_hints=hints, changes=changes,
                           session=check_session(session))
    for line in changes:
        (logger.warning if " kept as it is " in line else logger.info)("kvbaton instrument(): %s", line)
    registrations: list[tuple[KvbatonChatCompletionClient, list[dict[str, str]]]] = []
    for holder, name, original, model_client in plans:
        if model_client is None:
            continue
        _close_with(original, model_client)
        holder._model_client = model_client
        inst.model_clients[name] = model_client
        system = [{"role": "system", "content": m.content} for m in getattr(holder, "_system_messages", [])]
        if system and name != selector:
            registrations.append((model_client, system))
    for member in members:
        _wrap_turns(member, inst)
        member.kvbaton = inst
    for model_client, system in registrations:
        if isinstance(model_client.kvbaton_client, Client):  # an async client registers on the agent's first request
            model_client.register_agent_sync(system, prefill=prefill)
    _wrap_reset(obj, inst, "reset" if participants else "on_reset")
    _wrap_runs(obj, inst)
    _wrap_dump(obj, {"client": target_of(backend), "prefill": prefill, "hints": hints,
                     **({"session": session} if session is not None else {}), **client_options})
    obj.kvbaton = inst
    obj.step_graph = graph
    return agent_or_team


# -- serialization ----------------------------------------------------------------------------------


class InstrumentedConfig(BaseModel):
    """An instrumented AutoGen component: the component as AutoGen dumps it, and instrument()'s options."""

    component: ComponentModel
    options: dict[str, Any] = Field(default_factory=dict, description="instrument()'s arguments (client: a target).")


class Instrumented(ComponentBase[BaseModel], Component[InstrumentedConfig]):
    """The loader of an instrumented agent or team: ``load_component`` loads the original component
    and returns it instrumented (:func:`instrument`); nothing else is ever an ``Instrumented``."""

    component_type = "team"  # load_component checks the loaded object's own type, not this one
    component_config_schema = InstrumentedConfig
    component_provider_override = "kvbaton.adapters.autogen.Instrumented"

    def _to_config(self) -> InstrumentedConfig:  # pragma: no cover - never instantiated
        raise NotImplementedError("Instrumented only loads components")

    @classmethod
    def _from_config(cls, config: InstrumentedConfig) -> Any:
        options = dict(config.options)
        loaded = ComponentLoader.load_component(config.component)
        return instrument(loaded, options.pop("client", None), **options)


def _wrap_dump(obj: Any, options: dict[str, Any]) -> None:
    """``obj.dump_component()`` dumps an :class:`Instrumented` component around the original dump."""
    original = getattr(obj, "_kvbaton_original_dump", None) or obj.dump_component

    def dump_component() -> ComponentModel:
        inner = original()
        return ComponentModel(
            provider=Instrumented.component_provider_override, component_type=inner.component_type,
            version=1, component_version=1, description=f"kvbaton-instrumented {inner.label or inner.provider}",
            label=inner.label, config={"component": inner.model_dump(), "options": dict(options)},
        )

    obj.dump_component = dump_component
    obj._kvbaton_original_dump = original


def _wrap_reset(obj: Any, inst: Instrumentation, method: str = "reset") -> None:
    """``team.reset()`` (``method``; a single agent's: ``on_reset``) also forgets which agents ran (the next
    run starts from the entry points) and releases every handle the model clients hold: the conversation
    their replies belonged to is gone."""
    saved = f"_kvbaton_original_{method}"
    original = getattr(obj, saved, None) or getattr(obj, method, None)
    if original is None:
        return

    async def reset(*args: Any, **kwargs: Any) -> Any:
        try:
            return await original(*args, **kwargs)
        finally:
            inst.reset()
            await inst.release_all()

    setattr(obj, method, reset)
    setattr(obj, saved, original)


def _close_with(original: Any, substitute: KvbatonChatCompletionClient) -> None:
    """Closing the model client the app built (and still holds) closes the kvbaton client put in its place
    too, so the app's own ``await model_client.close()`` releases what the substitute created."""
    if original is substitute:
        return
    substitutes = getattr(original, "_kvbaton_substitutes", None)
    if substitutes is not None:  # patched already (shared by several agents, or instrumented again)
        substitutes.append(substitute)
        return
    close = original.close
    substitutes = [substitute]

    async def close_all(*args: Any, **kwargs: Any) -> Any:
        try:
            return await close(*args, **kwargs)
        finally:
            for model_client in substitutes:
                await model_client.close()

    try:
        original.close = close_all
        original._kvbaton_substitutes = substitutes
    except (AttributeError, TypeError, ValueError):  # a frozen client: its substitute is closed with the team
        logger.debug("cannot tie the close of %r to its kvbaton substitute", original, exc_info=True)


def _wrap_runs(obj: Any, inst: Instrumentation) -> None:
    """``obj.run`` / ``obj.run_stream`` become ownership scopes (see the module docstring)."""
    run = getattr(obj, "_kvbaton_original_run", None) or getattr(obj, "run", None)
    run_stream = getattr(obj, "_kvbaton_original_run_stream", None) or getattr(obj, "run_stream", None)
    if run is None or run_stream is None:
        return

    async def begin() -> tuple[Any, Any]:
        inst.runs += 1
        scope = run_scope(f"autogen run of {getattr(obj, 'name', 'a team')}") if inst.runs == 1 else None
        if scope is not None:
            scope.session = inst.reuse_session
        return scope, scope.activate() if scope is not None else None

    async def end(scope: Any, token: Any) -> None:
        inst.runs -= 1
        if scope is not None:
            scope.deactivate(token)
            await inst.run_finished(scope)

    async def scoped_run(*args: Any, **kwargs: Any) -> Any:
        scope, token = await begin()
        try:
            return await run(*args, **kwargs)
        finally:
            await end(scope, token)

    async def scoped_run_stream(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        scope, token = await begin()
        try:
            async for item in run_stream(*args, **kwargs):
                yield item
        finally:
            await end(scope, token)

    obj.run, obj.run_stream = scoped_run, scoped_run_stream
    obj._kvbaton_original_run, obj._kvbaton_original_run_stream = run, run_stream


def agent(
    factory: Callable[..., Any] | None = None,
    *,
    client: Client | AsyncClient | str | None = None,
    prefill: bool = False,
    **client_options: Any,
) -> Any:
    """Decorator for a function that builds an ``AssistantAgent``: the agent it returns is instrumented
    (:func:`instrument`). Works bare (``@agent``) or with options (``@agent(max_tokens=64)``), on
    plain and ``async`` factories."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                built = await fn(*args, **kwargs)
                return await asyncio.to_thread(
                    instrument, built, client, prefill=prefill, **client_options
                )

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return instrument(fn(*args, **kwargs), client, prefill=prefill, **client_options)

        return wrapper

    return decorate(factory) if factory is not None else decorate


def handle_of(message: BaseChatMessage) -> str | None:
    """The kvbaton handle id stamped on an AutoGen message, if any."""
    return (getattr(message, "metadata", None) or {}).get(METADATA_KEY)


__all__ = [
    "APPROXIMATE_KEY",
    "EXACT_KEY",
    "HintEvent",
    "Instrumentation",
    "Instrumented",
    "InstrumentedConfig",
    "agent",
    "handle_of",
    "instrument",
    "stamp",
]
