"""LangGraph adapter: put kvbaton under an existing LangGraph app in one line.

    from kvbaton.adapters.langgraph import KvbatonChatModel, wrap
    app = wrap(graph.compile(), client)          # behaves like the compiled graph, and is a Runnable
    app.step_graph                               # the Agent Step Graph read from app.builder
    app.invoke({...})                            # sends STE hints before each step

- ``wrap`` (:mod:`.app`) finds the chat models the app's nodes use (:mod:`.models`) and routes them
  through kvbaton — ``KvbatonChatModel`` runs on kvbaton; an OpenAI-SDK model (``ChatOpenAI``) goes
  to the kvbaton server named by ``base_url`` / ``$KVBATON_URL`` or by its own base URL (mode 2,
  :mod:`.openai_dropin`) — or raises :class:`~kvbaton.errors.InvalidRequest` saying what is missing.
- :func:`extract_step_graph` reads the graph from ``app.builder`` (static edges, joins, conditional
  branches, Command destinations, deferred nodes, subgraphs), not from ``get_graph()`` (:mod:`.graph`).
- At run time a callback registered with ``register_configure_hook`` (active only inside the
  wrapper's calls; :mod:`.run`) sees node starts and ends, sends ``client.hints(step_graph, running,
  finished)`` before each step, learns wildcard routes from observed hops, and registers each
  agent's fixed prompt once per client.
- :class:`KvbatonChatModel` is the chat model (handles on messages; :mod:`.chat_model`).
- Each call (``invoke``/``stream``/``batch`` and their async twins) is an ownership scope
  (:mod:`kvbaton.scope`): the handles created during the run are released when it ends, except
  those its result references — with a checkpointer, its thread's latest checkpoint. Those are
  held per ``thread_id`` (at most ``max_retained_handles``, the oldest released first) until the
  thread's next run supersedes them (released unless referenced again) or ``app.release(thread_id)``;
  ``client.keep(handle)`` keeps one past every scope. In mode 2 the server holds them per session.
- Mode 2's requests carry the adapter's reuse policy (``reuse="auto"`` by default, as
  ``KvbatonChatModel``'s): wrapping is the opt-in.

What is not LangGraph-specific — the hint sender, agent registration, the tool-call convention, the
best handle, sync/async dispatch — is :mod:`kvbaton.adapters.core`, shared with the AutoGen adapter.

See docs/langgraph.md.
"""

from __future__ import annotations

from .app import LangGraphApp, wrap
from .chat_model import KVBATON_KEY, ChatKvbaton, KvbatonChatModel, agent_from_metadata, handle_of
from .graph import ExtractedGraph, extract_step_graph
from .models import FoundModel, find_chat_models

__all__ = [
    "KVBATON_KEY",
    "ChatKvbaton",
    "ExtractedGraph",
    "FoundModel",
    "KvbatonChatModel",
    "LangGraphApp",
    "agent_from_metadata",
    "extract_step_graph",
    "find_chat_models",
    "handle_of",
    "wrap",
]
