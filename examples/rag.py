"""Retrieval-augmented answering as an AutoGen GraphFlow instrumented by kvbaton:

    planner -> retriever -> solver_1 .. solver_k (in parallel) -> synthesizer

The retriever is a plain (non-LLM) agent that picks the most relevant documents from the small
product manual shipped in ``examples/data/``. All LLM agents share one team system prompt and see
the same conversation; each agent's role is its last instruction (a model context that appends it),
so every solver's prompt starts with the same tokens: system prompt, question, plan, evidence.

In kvbaton mode (``instrument(team, client, prefill=True)``) the retriever materializes that shared
prefix once, right after retrieving, so the k solvers, started together, find the evidence's KV in
the prefix cache and prefill only their own instruction; the synthesizer reuses it too.
``--baseline text`` runs the same team with text passing: no prefix cache, no handles, every agent
prefills its whole prompt.

    python examples/rag.py --k 3 --baseline both
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from autogen_agentchat.agents import AssistantAgent, BaseChatAgent
from autogen_agentchat.base import Response
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import BaseChatMessage, TextMessage
from autogen_agentchat.teams import DiGraphBuilder, GraphFlow
from autogen_core import CancellationToken
from autogen_core.model_context import UnboundedChatCompletionContext
from autogen_core.models import LLMMessage, SystemMessage, UserMessage
from kvbaton.adapters.autogen import KvbatonChatCompletionClient, instrument, render_messages
from kvbaton.examples.common import KVBATON, MeteredClient, Report, connect, run_example, say

QUESTION = ("We live in a small house with rooftop solar and want backup for the fridge and the router during "
            "outages. How big a Lumen system do we need, what will it cost, and what maintenance does it need?")
SYSTEM = ("You are part of a team that answers customer questions about the Lumen home battery. Use only the "
          "evidence from the manual that the retriever provides. Be short and concrete.")
PLANNER = "Planner: list the two or three facts we must look up to answer the question."
SOLVER_FOCUS = ["sizing and power", "cost and savings", "maintenance and warranty", "installation and safety",
                "backup behaviour", "troubleshooting"]
SYNTHESIZER = "Synthesizer: combine the solvers' answers into one final answer of two sentences."


def load_documents() -> dict[str, str]:
    """The manual shipped with the example (``kvbaton.examples/data/*.md``)."""
    data = resources.files("kvbaton.examples").joinpath("data")
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(data.iterdir(), key=lambda p: p.name)
            if p.name.endswith(".md")}


def _words(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 3]


def retrieve(query: str, documents: dict[str, str], top_n: int) -> list[str]:
    """The ``top_n`` documents sharing the most query words (weighted by rarity across documents)."""
    doc_words = {name: Counter(_words(text)) for name, text in documents.items()}
    df = Counter(w for counts in doc_words.values() for w in counts)
    query_words = set(_words(query))

    def score(name: str) -> float:
        return sum(min(doc_words[name][w], 3) / df[w] for w in query_words if w in doc_words[name])

    return sorted(documents, key=lambda name: (-score(name), name))[:top_n]


class RoleContext(UnboundedChatCompletionContext):
    """The conversation followed by this agent's role instruction, so agents differ only at the end."""

    def __init__(self, instruction: str) -> None:
        super().__init__()
        self.instruction = instruction

    async def get_messages(self) -> list[LLMMessage]:
        return [*self._messages, UserMessage(content=self.instruction, source="moderator")]


class Retriever(BaseChatAgent):
    """Retrieves evidence for the conversation so far; ``on_evidence`` sees the conversation with it."""

    def __init__(self, documents: dict[str, str], top_n: int,
                 on_evidence: Callable[[list[BaseChatMessage]], None] | None = None, quiet: bool = True) -> None:
        super().__init__("retriever", description="Finds the manual sections relevant to the question.")
        self.documents, self.top_n, self.on_evidence, self.quiet = documents, top_n, on_evidence, quiet
        self.seen: list[BaseChatMessage] = []

    @property
    def produced_message_types(self) -> Sequence[type[BaseChatMessage]]:
        return (TextMessage,)

    async def on_messages(self, messages: Sequence[BaseChatMessage], cancellation_token: CancellationToken) -> Response:
        self.seen.extend(messages)
        names = retrieve(" ".join(m.to_text() for m in self.seen), self.documents, self.top_n)
        say(self.quiet, "retriever", "retrieved " + ", ".join(names))
        evidence = "Evidence from the manual:\n\n" + "\n\n".join(self.documents[n].strip() for n in names)
        reply = TextMessage(content=evidence, source=self.name)
        if self.on_evidence is not None:
            await asyncio.to_thread(self.on_evidence, [*self.seen, reply])
        return Response(chat_message=reply)

    async def on_reset(self, cancellation_token: CancellationToken) -> None:
        self.seen.clear()


def shared_prefix(client: MeteredClient, conversation: list[BaseChatMessage]) -> list[int]:
    """The tokens every solver's prompt starts with, rendered exactly as the model client renders them."""
    messages: list[LLMMessage] = [SystemMessage(content=SYSTEM)]
    messages += [UserMessage(content=m.to_model_text(), source=m.source) for m in conversation]
    return client.chat_tokens(render_messages(messages), add_generation_prompt=False)


def build_team(client: MeteredClient, k: int, top_n: int, max_tokens: int, kv: bool, quiet: bool) -> GraphFlow:
    def llm_agent(name: str, instruction: str) -> AssistantAgent:
        model = KvbatonChatCompletionClient(client, agent=name, max_tokens=max_tokens, reuse_handles=kv,
                                            register_prompt=kv)
        return AssistantAgent(name, model_client=model, system_message=SYSTEM, model_context=RoleContext(instruction))

    def prewarm(conversation: list[BaseChatMessage]) -> None:
        client.materialize(shared_prefix(client, conversation), agent="retriever")

    planner = llm_agent("planner", PLANNER)
    retriever = Retriever(load_documents(), top_n, prewarm if kv else None, quiet)
    solvers = [llm_agent(f"solver_{i + 1}", f"Solver {i + 1}: answer the question, focusing on "
                         f"{SOLVER_FOCUS[i % len(SOLVER_FOCUS)]}, in one sentence.") for i in range(k)]
    synthesizer = llm_agent("synthesizer", SYNTHESIZER)
    builder = DiGraphBuilder()
    for agent in (planner, retriever, *solvers, synthesizer):
        builder.add_node(agent)
    builder.add_edge(planner, retriever)
    for solver in solvers:
        builder.add_edge(retriever, solver).add_edge(solver, synthesizer)  # fan-out, then an "all" join
    builder.set_entry_point(planner)
    return GraphFlow([planner, retriever, *solvers, synthesizer], graph=builder.build(),
                     termination_condition=MaxMessageTermination(k + 4))


def run_mode(mode: str, args: argparse.Namespace) -> Report:
    client = connect(mode)
    kv = mode == KVBATON
    if not args.quiet:
        print(f"\n[{mode}] {len(load_documents())} documents, top {args.top_n} retrieved, k={args.k} solvers")
    client.start()
    team = build_team(client, args.k, args.top_n, args.max_tokens, kv, args.quiet)
    if kv:
        instrument(team, client, prefill=True)  # step graph + hints, handles between agents, system prompt cached
    result = asyncio.run(team.run(task=QUESTION))
    outputs: dict[str, str] = {}
    for message in result.messages:
        if message.source not in ("user", "retriever"):
            outputs[message.source] = message.to_text()
            say(args.quiet, message.source, message.to_text())
    report = client.report(mode, outputs)
    client.close()
    return report


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--k", type=int, default=3, help="parallel solvers sharing the evidence (default 3)")
    parser.add_argument("--top-n", type=int, default=3, help="documents retrieved (default 3)")


def _check(args: argparse.Namespace) -> str | None:
    return None if 1 <= args.k <= 16 and args.top_n >= 1 else "need 1 <= k <= 16 and top-n >= 1"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_example("rag", __doc__, argv, max_tokens=24, arguments=_arguments, run_mode=run_mode, check=_check)


if __name__ == "__main__":
    main(sys.argv[1:])
