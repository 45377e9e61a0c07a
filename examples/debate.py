"""A debate: three debaters with distinct personas and a judge over one shared long context.

A LangGraph app (optimist -> skeptic -> pragmatist, repeated for N rounds, then the judge) whose
nodes call ``KvbatonChatModel``; ``kvbaton.adapters.langgraph.wrap`` extracts its step graph and
sends steps-to-execution hints. The shared context (team notes, ~1.5K tokens) is the system
message; each turn appends the moderator's instruction and the reply to the transcript, so every
call starts with the previous call's prompt and reply, and the handle on the previous AIMessage
covers all of it: only the new instruction is prefilled.

``--baseline text`` runs the same graph with text passing: no handles on messages, no prefix cache,
so every turn re-reads the whole context and transcript.

    python examples/debate.py --baseline both        # or: kvbaton run debate --baseline both
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Annotated, Any, TypedDict

from kvbaton.adapters.langgraph import KvbatonChatModel, wrap
from kvbaton.bench.corpus import document
from kvbaton.examples.common import KVBATON, MeteredClient, connect, run_example, say
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph, add_messages

DEBATERS = {
    "optimist": "an upbeat product manager who looks for opportunities and argues FOR the proposal",
    "skeptic": "a cautious site-reliability engineer who looks for risks and argues AGAINST the proposal",
    "pragmatist": "a budget-minded engineering director who looks for a workable compromise",
}
JUDGE = "judge"
TOPIC = "Should the team freeze all new features for one quarter to pay down reliability debt?"


class State(TypedDict):
    messages: Annotated[list[Any], add_messages]
    round: int


def shared_context(words: int) -> str:
    return (f"You moderate a debate between three colleagues. Topic: {TOPIC}\n"
            "Background: the team's meeting notes from the last weeks.\n\n" + document(words, seed=3))


def build_graph(llm: Any, rounds: int, quiet: bool) -> Any:
    """The debate graph (uncompiled). ``llm`` is any LangChain chat model."""

    def debater(name: str, persona: str) -> Any:
        def node(state: State) -> dict[str, Any]:
            instruction = HumanMessage(
                f"Round {state['round']}. {name.capitalize()}, you are {persona}. Using the notes, give your "
                "argument in one or two sentences, and answer the previous speaker.")
            reply = llm.invoke([*state["messages"], instruction])
            say(quiet, name, str(reply.content))
            update: dict[str, Any] = {"messages": [instruction, reply]}
            if name == list(DEBATERS)[-1]:
                update["round"] = state["round"] + 1
            return update
        return node

    def judge(state: State) -> dict[str, Any]:
        instruction = HumanMessage("Judge: the debate is over. Name the debater with the strongest case and "
                                   "give one reason.")
        reply = llm.invoke([*state["messages"], instruction])
        say(quiet, JUDGE, str(reply.content))
        return {"messages": [instruction, reply]}

    graph = StateGraph(State)
    for name, persona in DEBATERS.items():
        graph.add_node(name, debater(name, persona))
    graph.add_node(JUDGE, judge)
    names = list(DEBATERS)
    graph.add_edge(START, names[0])
    for a, b in itertools.pairwise(names):
        graph.add_edge(a, b)
    graph.add_conditional_edges(names[-1], lambda s: names[0] if s["round"] <= rounds else JUDGE,
                                {names[0]: names[0], JUDGE: JUDGE})
    graph.add_edge(JUDGE, END)
    return graph


def run_mode(mode: str, args: argparse.Namespace) -> Any:
    client: MeteredClient = connect(mode)
    kv = mode == KVBATON
    llm = KvbatonChatModel(client=client, max_tokens=args.max_tokens, pass_handles=kv, register_agents=kv)
    compiled = build_graph(llm, args.rounds, args.quiet).compile()
    app = wrap(compiled, client) if kv else compiled  # the one line that puts kvbaton under the app
    context = shared_context(args.context_words)
    if not args.quiet:
        tokens = len(client.chat_tokens([{"role": "system", "content": context}], add_generation_prompt=False))
        print(f"\n[{mode}] shared context: {tokens} tokens; {len(DEBATERS)} debaters x {args.rounds} rounds + judge")
    client.start()
    final = app.invoke({"messages": [SystemMessage(context)], "round": 1}, {"recursion_limit": 100})
    report = client.report(mode, {"verdict": str(final["messages"][-1].content)})
    client.close()
    return report


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="debate rounds (default 3)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_example("debate", __doc__, argv, max_tokens=16, arguments=_arguments, run_mode=run_mode,
                       context_words=1000, context="the shared notes")


if __name__ == "__main__":
    main(sys.argv[1:])
