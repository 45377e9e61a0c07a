"""How a shape of the family runs: the embedded client turn by turn, a LangGraph app, or an AutoGen team.

Each runner takes the shape, a :class:`~kvbaton.bench.family_turns.RecordingClient` (every model call goes
through it) and the reuse policy, and runs every turn once; with ``teacher`` (the outputs of a reference run)
every turn's prompt quotes the reference outputs instead of this run's own (a teacher-forced pass), so each
turn gets exactly the reference run's prompt.

- ``plain``: ``client.generate(messages, agent=..., reuse=...)`` per turn; a shape whose results are released
  releases each turn's handle as soon as the turn is done, the others hold them until the shape ends;
- ``langgraph``: a ``StateGraph`` with one node per turn, in order (a map-reduce's part turns as a ``Send``
  fan-out into the rest), each node calling its agent's ``KvbatonChatModel`` (``reuse=``), the compiled app
  ``wrap``-ped with the client: one run, one reuse session, its handles released when the run ends;
- ``autogen``: a ``SelectorGroupChat`` of ``AssistantAgent``\\ s, one per agent, whose speaker order is the
  shape's (a ``selector_func``; the team's own model is never asked), ``instrument``-ed with the client
  (``reuse=``): the team's task is the document and the ask, each agent's system message its persona and
  instruction (:func:`kvbaton.bench.family.system_message`). AutoGen builds the prompts from its own
  conversation, so a team is never teacher-forced: its turns are compared where their prompts are the same.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Sequence
from typing import Annotated, Any

from kvbaton.bench.family import Shape, system_message
from kvbaton.bench.family_turns import TURN, RecordingClient


def quoted(outputs: dict[int, str] | Sequence[str], n: int) -> list[str]:
    """Outputs as a list of ``n`` (missing ones empty): what ``Workload.messages`` quotes."""
    if isinstance(outputs, dict):
        return [outputs.get(i, "") for i in range(n)]
    return list(outputs) + [""] * (n - len(outputs))


def run_plain(shape: Shape, client: RecordingClient, reuse: str, teacher: Sequence[str] | None) -> None:
    wl = shape.workload
    outputs: list[str] = []
    held = []
    try:
        for i, turn in enumerate(wl.turns):
            token = TURN.set(i)
            try:
                result = client.generate(wl.messages(i, quoted(teacher or outputs, len(wl.turns))), agent=turn.agent,
                                         reuse=reuse)
            finally:
                TURN.reset(token)
            outputs.append(result.text)
            if wl.release:
                client.release(result.handle)
            else:
                held.append(result.handle)
    finally:
        if held:
            client.release(held)


def run_langgraph(shape: Shape, client: RecordingClient, reuse: str, teacher: Sequence[str] | None) -> None:
    from kvbaton.adapters.langgraph import KvbatonChatModel, wrap
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send
    from typing_extensions import TypedDict

    class State(TypedDict):
        outputs: Annotated[dict[int, str], operator.or_]  # the Send branches' writes are merged

    wl = shape.workload
    models = {name: KvbatonChatModel(client=client, agent=name, reuse=reuse, max_tokens=1) for name in wl.agents}

    def run_turn(i: int, outputs: dict[int, str]) -> dict[str, dict[int, str]]:
        system, user = wl.messages(i, quoted(teacher or outputs, len(wl.turns)))
        token = TURN.set(i)
        try:  # the recording client gives each turn its own sampling (max_tokens above is replaced)
            reply = models[wl.turns[i].agent].invoke([SystemMessage(system["content"]), HumanMessage(user["content"])])
        finally:
            TURN.reset(token)
        return {"outputs": {i: str(reply.content)}}

    graph = StateGraph(State)
    fanned = [i for i, t in enumerate(wl.turns) if t.part is not None]
    rest = [i for i in range(len(wl.turns)) if i not in fanned]
    if fanned:
        graph.add_node("part", lambda payload: run_turn(payload["index"], {}))
        graph.add_conditional_edges(START, lambda state: [Send("part", {"index": i}) for i in fanned], ["part"])
    previous = "part" if fanned else START
    for i in rest:
        graph.add_node(f"t{i}", lambda state, i=i: run_turn(i, state["outputs"]))
        graph.add_edge(previous, f"t{i}")
        previous = f"t{i}"
    graph.add_edge(previous, END)
    wrap(graph.compile(), client).invoke({"outputs": {}})


def run_autogen(shape: Shape, client: RecordingClient, reuse: str, teacher: Sequence[str] | None) -> None:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.teams import SelectorGroupChat
    from autogen_ext.models.replay import ReplayChatCompletionClient
    from kvbaton.adapters.autogen import instrument

    wl = shape.workload
    order = [t.agent for t in wl.turns]
    names = {name: name.replace("-", "_") for name in wl.agents}  # AutoGen agent names are identifiers
    agents = [AssistantAgent(names[name], model_client=ReplayChatCompletionClient(["unused"]),
                             system_message=system_message(shape, name)) for name in dict.fromkeys(order)]

    def next_speaker(messages: Sequence[Any]) -> str:
        spoken = sum(1 for m in messages if getattr(m, "source", "user") != "user")
        return names[order[min(spoken, len(order) - 1)]]

    team = SelectorGroupChat(agents, model_client=ReplayChatCompletionClient(["unused"]), selector_func=next_speaker,
                             allow_repeated_speaker=True, termination_condition=MaxMessageTermination(len(order) + 1))
    instrument(team, client, reuse=reuse, hints=False, max_tokens=1)

    async def conversation() -> None:  # one event loop; reset() releases what the model clients still hold
        await team.run(task=shape.task)
        await team.reset()

    asyncio.run(conversation())


RUNNERS = {"plain": run_plain, "langgraph": run_langgraph, "autogen": run_autogen}

__all__ = ["RUNNERS", "quoted", "run_autogen", "run_langgraph", "run_plain"]
