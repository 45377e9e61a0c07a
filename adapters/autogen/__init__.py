"""AutoGen (autogen-agentchat 0.7) adapter: kvbaton under existing agents and teams.

``instrument(agent_or_team)`` puts each ``AssistantAgent``'s model calls on kvbaton, keeping the
user's client and its settings unless told otherwise: a :class:`KvbatonChatCompletionClient` keeps its
engine and settings (tagged with the agent's name); an ``OpenAIChatCompletionClient`` pointed at a
``kvbaton serve`` server becomes a kvbaton client on that server with its sampling settings; with
``client=`` every model client moves to that kvbaton client, settings carried over. Every change is
logged and listed (``obj.kvbaton.changes``); nothing on kvbaton at all is an error. It registers
the agent's system message as its fixed prompt, extracts the team's Agent Step Graph (GraphFlow,
RoundRobinGroupChat, SelectorGroupChat, Swarm), sends steps-to-execution hints before every turn,
and stamps each reply's ``metadata["kvbaton_handle"]`` (and ``kvbaton_exact``: ``"false"`` for a
reply served from approximately reused K/V, see ``KvbatonChatCompletionClient(reuse=...)``).
``@agent`` does the same for an AssistantAgent factory.

The hints go out through :class:`kvbaton.adapters.core.HintSender`, shared with the LangGraph adapter.

Modules: :mod:`.instrumentation` (``instrument``, ``@agent``, what they attach), :mod:`.plan` (what
happens to each model client), :mod:`.graph` (step graphs of the team types), :mod:`.client`
(:class:`KvbatonChatCompletionClient`), :mod:`.handle_table` (the side table of reply handles),
:mod:`.messages` (AutoGen messages and tools as kvbaton chat).

A run (``run`` / ``run_stream``) of an instrumented team or agent is an ownership scope: when it
ends, each model client releases what it created but its latest reply's handle (the one its agent's
next turn reuses), and handles other kvbaton calls made during the run are released
(:mod:`kvbaton.adapters.ownership`); ``client.keep(handle)`` keeps one. A model client holds at most
``max_retained_handles`` (the oldest released first); ``team.reset()`` releases everything the model
clients hold, and closing a model client the app built closes the kvbaton clients put in its place.

Instrumentation survives ``dump_component`` / ``load_component``: an instrumented object dumps as an
:class:`Instrumented` component that loads the original back and instruments it again.

See docs/autogen.md.
"""

from __future__ import annotations

from ..connections import register_connection, shared_connection
from .client import KvbatonChatCompletionClient, KvbatonChatCompletionClientConfig, KvbatonCreateResult
from .graph import extract_step_graph, graph_from_digraph, graph_round_robin, graph_selector, graph_swarm
from .handle_table import HandleTable
from .instrumentation import HintEvent, Instrumentation, Instrumented, InstrumentedConfig, agent, handle_of, instrument
from .messages import render_messages, tool_schema

__all__ = [
    "HandleTable",
    "HintEvent",
    "Instrumentation",
    "KvbatonChatCompletionClient",
    "KvbatonChatCompletionClientConfig",
    "KvbatonCreateResult",
    "Instrumented",
    "InstrumentedConfig",
    "agent",
    "extract_step_graph",
    "graph_from_digraph",
    "graph_round_robin",
    "graph_selector",
    "graph_swarm",
    "handle_of",
    "instrument",
    "register_connection",
    "render_messages",
    "shared_connection",
    "tool_schema",
]
