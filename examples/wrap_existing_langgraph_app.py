"""An existing LangGraph app written for OpenAI's ``ChatOpenAI``, put on kvbaton without changing it.

``build_app`` below is an ordinary app: a researcher, a writer and an editor work through a shared
briefing with ``ChatOpenAI(model="gpt-4o-mini")``. Nothing in it knows about kvbaton. Two ways to
run it on kvbaton, both against a kvbaton server (``kvbaton serve``; here one is started in this
process on a free loopback port, with the embedded default model):

- kvbaton mode, one line: ``app = wrap(build_app(), base_url=server, redirect_openai=True)``. Inside
  the wrapper's runs ChatOpenAI's requests to api.openai.com go to the server (without the OpenAI
  key) tagged with the node's name, the server
  resumes each agent from its latest handle, the step graph's hints keep the next agents' KV warm.
- ``--baseline text``, no line at all: ``OPENAI_BASE_URL=<server>/v1`` points the unchanged app at a
  server that keeps no handles and has no prefix cache, i.e. plain text passing.

    python examples/wrap_existing_langgraph_app.py --baseline both

Against your own server, the same two options apply unchanged: ``kvbaton serve`` in one shell, then
``wrap(app, base_url="http://127.0.0.1:8470", redirect_openai=True)`` (or ``OPENAI_BASE_URL`` and a bare
``wrap(app)``, which finds the server there) in the app's process.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, Self, TypedDict

from kvbaton.bench.corpus import document
from kvbaton.examples.common import KVBATON, MeteredClient, Report, connect, run_example, say
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph, add_messages

# -- the existing app: written for OpenAI, nothing here knows about kvbaton ------------------------


class State(TypedDict):
    messages: Annotated[list[Any], add_messages]


STEPS = {
    "researcher": "Researcher: list the two most important facts in the briefing.",
    "writer": "Writer: turn those facts into a two-sentence status update for the team.",
    "editor": "Editor: shorten the update to one clear sentence.",
}


def build_app(max_tokens: int = 24) -> Any:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="gpt-4o-mini", temperature=0, max_tokens=max_tokens)

    def step(instruction: str) -> Callable[[State], dict[str, Any]]:
        def node(state: State) -> dict[str, Any]:
            ask = HumanMessage(instruction)
            return {"messages": [ask, llm.invoke([*state["messages"], ask])]}
        return node

    graph = StateGraph(State)
    names = list(STEPS)
    for name in names:
        graph.add_node(name, step(STEPS[name]))
    graph.add_edge(START, names[0])
    for a, b in itertools.pairwise(names):
        graph.add_edge(a, b)
    graph.add_edge(names[-1], END)
    return graph.compile()


# -- running it on kvbaton ---------------------------------------------------------------------------


class LocalServer:
    """``kvbaton serve``'s app on a free loopback port, in a thread of this process, with a tap that
    records each chat completion's engine timings (the ``kvbaton`` field of the response body)."""

    def __init__(self, client: MeteredClient, agents: collections.deque[str], *, keep_handles: bool) -> None:
        import uvicorn
        from kvbaton.backend.server import create_app

        # max_agents=0: the server retains no agent handle between requests (the text baseline); the app's
        # own model name is one of the served names (an explicit alias, as vLLM's --served-model-name)
        app = create_app(client.engine, served_model_names=[client.engine.model_name, "gpt-4o-mini"],
                         **({} if keep_handles else {"max_agents": 0}))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client, self.agents = client, agents
        config = uvicorn.Config(self._tap(app), host="127.0.0.1", port=port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def _tap(self, app: Any) -> Any:
        async def tapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
                await app(scope, receive, send)
                return
            body = bytearray()

            async def capture(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body":
                    body.extend(message.get("body", b""))
                    if not message.get("more_body"):
                        self._record(bytes(body))
                await send(message)

            await app(scope, receive, capture)
        return tapped

    def _record(self, body: bytes) -> None:
        try:
            t = json.loads(body)["kvbaton"]["timings"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return  # an error answer: nothing to record
        # The app is sequential: the i-th request is the i-th chat model start the callback saw.
        agent = self.agents.popleft() if self.agents else "-"
        self.client.record(agent, "chat", t["ttft_s"], t["tokens_reused"], t["tokens_prefilled"],
                           t["tokens_generated"])
        self.client.sample()
        self.client.note_footprint(t["tokens_reused"] + t["tokens_prefilled"] + t["tokens_generated"])

    def __enter__(self) -> Self:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the local kvbaton server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class AgentOrder(BaseCallbackHandler):
    """Notes which node starts each chat model call (for the per-agent table)."""

    def __init__(self, agents: collections.deque[str]) -> None:
        self.agents = agents

    def on_chat_model_start(self, serialized: Any, messages: Any, *, metadata: dict[str, Any] | None = None,
                            **kwargs: Any) -> None:
        self.agents.append(str((metadata or {}).get("langgraph_node", "-")))


def run_mode(mode: str, args: argparse.Namespace) -> Report:
    from kvbaton.adapters.langgraph import wrap

    client = connect(mode)
    kv = mode == KVBATON
    agents: collections.deque[str] = collections.deque()
    os.environ.setdefault("OPENAI_API_KEY", "not-needed-for-kvbaton")  # ChatOpenAI insists on one
    saved = os.environ.pop("OPENAI_BASE_URL", None)
    try:
        with LocalServer(client, agents, keep_handles=kv) as server:
            if kv:
                app = wrap(build_app(args.max_tokens), base_url=server.url, redirect_openai=True)  # <- the one line
            else:
                os.environ["OPENAI_BASE_URL"] = server.url + "/v1"  # <- or only this, no kvbaton features
                app = build_app(args.max_tokens)
            if not args.quiet:
                print(f"\n[{mode}] kvbaton server at {server.url}; app: {' -> '.join(STEPS)}")
            briefing = SystemMessage("Briefing for the team:\n" + document(args.context_words, seed=8))
            client.start()
            final = app.invoke({"messages": [briefing]}, {"callbacks": [AgentOrder(agents)]})
            for message in final["messages"][2::2]:
                say(args.quiet, "reply", str(message.content))
            report = client.report(mode, {"final": str(final["messages"][-1].content)})
    finally:
        os.environ.pop("OPENAI_BASE_URL", None)
        if saved is not None:
            os.environ["OPENAI_BASE_URL"] = saved
    client.close()
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_example("wrap_existing_langgraph_app", __doc__, argv, max_tokens=24, run_mode=run_mode,
                       context_words=800, context="the shared briefing")


if __name__ == "__main__":
    main(sys.argv[1:])
