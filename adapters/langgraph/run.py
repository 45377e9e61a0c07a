"""The run time of a wrapped LangGraph app: one invocation's callback handler.

:class:`Run` follows the wrapped graph's top-level node starts and ends (LangChain callbacks), sends
``client.hints(step_graph, running, finished)`` before each step, reports the hops it observes so
the wrapper learns wildcard routes, registers each agent's fixed prompt for chat models that are not
kvbaton's own, and tags mode 2's OpenAI-SDK calls (:mod:`~kvbaton.adapters.langgraph.openai_dropin`).

A run is active while :data:`~kvbaton.adapters.langgraph.chat_model.ACTIVE_RUN` holds it: LangChain
then adds it to every callback manager configured in that context (nested runs included).
Invariant: hints are advisory and never break the app; only a chat model kvbaton cannot route raises.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Collection, Mapping
from typing import Any, Protocol
from uuid import UUID

from kvbaton.errors import InvalidRequest
from kvbaton.stepgraph import StepGraph
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tracers.context import register_configure_hook

from ..core import HintSender, register_fixed_prompt, sync_client
from .chat_model import ACTIVE_RUN, KVBATON_KEY, agent_from_metadata, to_chat
from .openai_dropin import CURRENT_CALL, CallTag

log = logging.getLogger("kvbaton.adapters.langgraph")

# The run state of a wrapped call is also its callback handler: LangChain adds it to every
# callback manager configured while ACTIVE_RUN is set (inheritable, so nested runs see it too).
register_configure_hook(ACTIVE_RUN, inheritable=True)


class Wrapper(Protocol):
    """What a run reads and tells of the wrapper that started it (:class:`.app.LangGraphApp`): the run
    depends on this, not on the wrapper's module, so the two do not import each other."""

    client: Any  # the wrapper's control connection, set by the first run that finds one
    base_url: str | None
    step_graph: StepGraph
    join_sources: set[str]
    hint_sender: HintSender

    def learn(self, prev: dict[str, None], node: str) -> list[str]: ...

    def routed(self, node: str, started: Collection[str]) -> bool: ...

    def narrow(self, src: str) -> None: ...


class Run(BaseCallbackHandler):
    """One wrapped invocation: follows its top-level node starts and ends, sends hints."""

    run_inline = True
    raise_error = True  # only on_chat_model_start raises: a chat model kvbaton cannot route (never silent)
    ignore_retriever = True

    def __init__(self, wrapper: Wrapper, config: Any = None) -> None:
        self.wrapper = wrapper
        configurable = config.get("configurable") if isinstance(config, Mapping) else None
        configurable = configurable if isinstance(configurable, Mapping) else {}
        # the namespace the wrapped graph runs in: "" at the top, "outer:task" as a node of another graph
        ns = configurable.get("checkpoint_ns")
        self.base_ns: str = ns if isinstance(ns, str) else ""
        thread = configurable.get("thread_id")
        # mode 2: the server keeps each session's retained handles apart (X-Kvbaton-Session)
        self.session: str = str(thread) if thread is not None else uuid.uuid4().hex
        self.lock = threading.RLock()
        self.step: int | None = None
        self.current: dict[str, None] = {}  # nodes started in the current step
        self.prev: dict[str, None] = {}  # nodes of the previous step
        self.pending_join: dict[str, None] = {}  # finished join sources whose join has not fired yet
        self.node_runs: dict[UUID, str] = {}
        self.openai_calls: dict[UUID, CallTag] = {}
        self.to_narrow: set[str] = set()  # wildcard routers with hops learned in the current step
        self.last_hint: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self.unsent: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    # client discovery: a run without a client sends its hints to the first KvbatonChatModel's
    def bind_client(self, client: Any) -> None:
        control = sync_client(client)
        if control is None or self.wrapper.client is not None:
            return
        with self.lock:
            if self.wrapper.client is None:
                self.wrapper.client = control
            unsent, self.unsent = self.unsent, None
        if unsent is not None:
            self._send(*unsent)

    # -- callbacks --------------------------------------------------------------------------------
    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       tags: list[str] | None = None, metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        try:
            self._chain_start(run_id, tags, metadata)
        except Exception:  # noqa: BLE001 - hints are advisory: they never break the app
            log.exception("kvbaton: following a node start failed")

    def _chain_start(self, run_id: UUID, tags: list[str] | None, metadata: dict[str, Any] | None) -> None:
        if not metadata or not tags or "langgraph_node" not in metadata:
            return
        ns = metadata.get("langgraph_checkpoint_ns", "")
        if not any(t.startswith("graph:step:") for t in tags) or not self.own(ns):
            return  # not a node task of the wrapped graph (a subgraph's, or an enclosing graph's)
        node = metadata["langgraph_node"]
        step = metadata.get("langgraph_step")
        if node not in self.wrapper.step_graph.agents:
            return
        self.node_runs[run_id] = node
        self._node_start(node, step if isinstance(step, int) else -1)

    def own(self, ns: str) -> bool:
        """Whether checkpoint namespace ``ns`` is a node task of the wrapped graph itself."""
        if not self.base_ns:
            return "|" not in ns
        return ns.startswith(self.base_ns + "|") and "|" not in ns[len(self.base_ns) + 1:]

    def agent(self, metadata: Mapping[str, Any] | None) -> str | None:
        """The wrapped graph's node a call belongs to (see :func:`agent_from_metadata`)."""
        return agent_from_metadata(metadata, self.base_ns)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        node = self.node_runs.pop(run_id, None)
        if node is not None:
            with self.lock:
                if node in self.wrapper.join_sources:
                    self.pending_join[node] = None

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.node_runs.pop(run_id, None)

    def on_chat_model_start(self, serialized: Any, messages: list[list[Any]], *, run_id: UUID,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # KvbatonChatModel registers its own (exact) prompt; other chat models (ChatOpenAI on a
        # kvbaton server) are registered here with the wrapper's client.
        if ACTIVE_RUN.get() is not self:
            return  # the call of a nested wrapped graph: its own run handles it
        params = kwargs.get("invocation_params") or {}
        if params.get("_type") == "kvbaton" or not messages:
            return
        agent = self.agent(metadata)
        if not self.wrapper.base_url:
            ids = serialized.get("id") if isinstance(serialized, Mapping) else None
            name = ids[-1] if isinstance(ids, list) and ids else "a chat model"
            raise InvalidRequest(
                f"node {agent!r} called {name}, which this wrap() cannot route through kvbaton: use KvbatonChatModel, "
                "or give wrap() base_url=<kvbaton serve URL> (or set KVBATON_URL) for an OpenAI-SDK model"
            )
        tag = CallTag(agent)  # mode 2: the patched httpx send tags this call's requests
        CURRENT_CALL.set(tag)
        self.openai_calls[run_id] = tag
        if self.wrapper.client is not None:
            register_fixed_prompt(self.wrapper.client, agent, to_chat(messages[0]))  # never raises

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        tag = self.openai_calls.pop(run_id, None)
        if tag is None:
            return
        CURRENT_CALL.set(None)
        if not tag.reached:
            log.warning("kvbaton: the chat model call of node %r did not reach the kvbaton server at %s",
                        tag.agent, self.wrapper.base_url)
        for generations in getattr(response, "generations", ()):
            for generation in generations:
                message = getattr(generation, "message", None)
                if message is not None and tag.handle:
                    message.additional_kwargs[KVBATON_KEY] = {"handle": {"id": tag.handle}, "agent": tag.agent or ""}
                if message is not None and tag.exact is not None:
                    message.response_metadata[KVBATON_KEY] = {"exact": tag.exact}

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        if self.openai_calls.pop(run_id, None) is not None:
            CURRENT_CALL.set(None)

    # -- steps ------------------------------------------------------------------------------------
    def _node_start(self, node: str, step: int) -> None:
        graph = self.wrapper.step_graph
        with self.lock:
            if step != self.step:
                # the hops out of the previous step are all known now: narrow its wildcards
                for src in self.to_narrow:
                    self.wrapper.narrow(src)
                self.to_narrow.clear()
                consecutive = self.step is not None and step == self.step + 1
                self.prev = self.current if consecutive else {}
                self.current = {}
                self.step = step
            self.current[node] = None
            if self.prev:
                self.to_narrow.update(self.wrapper.learn(self.prev, node))
            for trigger in graph.triggers(node):
                if len(trigger) > 1 and all(p in self.pending_join for p in trigger):
                    for p in trigger:
                        self.pending_join.pop(p, None)
            running = tuple(self.current)
            # a router's completion counts until it has picked (see LangGraphApp.routed); a join source's
            # until its join fires
            finished = tuple(n for n in {**self.prev, **self.pending_join} if n not in self.current
                             and (n in self.pending_join or not self.wrapper.routed(n, self.current)))
        self._send(running, finished)

    def _send(self, running: tuple[str, ...], finished: tuple[str, ...]) -> None:
        with self.lock:
            if (running, finished) == self.last_hint:
                return
            if self.wrapper.client is None:
                self.unsent = (running, finished)
                return
            self.last_hint = (running, finished)
        self.wrapper.hint_sender.send(running, finished)


def reset_active(token: Any) -> None:
    """Leave a run entered with ``ACTIVE_RUN.set`` (``token``)."""
    try:
        ACTIVE_RUN.reset(token)
    except ValueError:  # an async generator closed from another context
        ACTIVE_RUN.set(None)
