"""LangGraph adapter overhead per LLM call, excluding model time.

An instant fake client (no model: canned text, a small handle) takes the place of the engine, so
what is measured is pure Python around the call. A supervisor-style LangGraph graph (planner ->
{researcher, coder} join -> reviewer -> router back to planner or on to summarizer) runs:

- ``direct``: nodes call ``client.generate`` themselves (the app without any adapter);
- ``model``: nodes call ``KvbatonChatModel`` (LangChain chat-model machinery, agent tagging,
  handle selection and the handle on the AIMessage), graph not wrapped;
- ``wrapped``: the same, graph wrapped by ``kvbaton.adapters.langgraph.wrap`` (callback, step
  tracking, STE hints before each step, learning wildcard routes, fixed-prompt registration).

Overhead per LLM call = (variant - direct) / calls, from the medians over ``--repeats`` graph
runs (every run's ms per call is in the record, with min/median/max). Target: ``wrapped`` <= 2 ms.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, TypedDict

from kvbaton.bench.spread import cell, measured
from kvbaton.handle import Handle, LineageStep, Op, Placement, Positions
from kvbaton.stream import TokenStream
from kvbaton.types import AgentInfo, Result, StreamChunk, Timings
from langgraph.graph import add_messages


class InstantClient:
    """A kvbaton client without a model: ``generate`` answers ``reply`` (a string or a callable of
    the messages) at once, with a handle whose lineage is the prompt's characters (as "tokens").
    ``hints`` computes STE like the engine does; calls are counted."""

    def __init__(self, reply: Any = "ok") -> None:
        self.reply = reply
        self.calls: list[dict[str, Any]] = []
        self.hint_calls: list[tuple[tuple[str, ...], tuple[str, ...], dict[str, float]]] = []
        self.agents: dict[str, Any] = {}
        self.released: set[str] = set()
        self.tokens: dict[str, list[int]] = {}  # the "KV" of each live handle, by id (messages carry no lineage)
        self._n = 0

    def _tokens(self, messages: Sequence[Any]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return [ord(c) % 50000 for c in text]

    def chat_tokens(self, messages: Sequence[Any], *, tools: Any = None, add_generation_prompt: bool = True) -> list[int]:
        return self._tokens(messages)

    def generate(self, messages: Sequence[Any], *, handle: Any = None, tools: Any = None, sampling: Any = None,
                 agent: str | None = None, **options: Any) -> Result:
        if handle is not None and (getattr(handle, "id", handle) in self.released):
            from kvbaton.errors import HandleReleased

            raise HandleReleased(f"handle {getattr(handle, 'id', handle)} was released")
        self.calls.append({"messages": list(messages), "handle": handle, "agent": agent, "options": options})
        text = self.reply(messages) if callable(self.reply) else self.reply
        prompt = self._tokens(messages)
        out = [ord(c) % 50000 for c in text]
        reused = 0
        if handle is not None:
            for a, b in zip(self.tokens.get(getattr(handle, "id", handle), ()), prompt):
                if a != b:
                    break
                reused += 1
        self._n += 1
        h = Handle(
            id=f"{self._n:032x}", model="instant", model_fingerprint="0", tokenizer_fingerprint="0",
            num_tokens=len(prompt) + len(out), positions=Positions(rope_type="default", rope_theta=1.0),
            lineage=(LineageStep(op=Op.GENERATE, token_ids=tuple(prompt + out)),), placement=Placement(device="cpu"),
        )
        self.tokens[h.id] = prompt + out
        timings = Timings(ttft_s=0.0, total_s=0.0, tokens_reused=reused, tokens_prefilled=len(prompt) - reused,
                          tokens_generated=len(out))
        return Result(text=text, token_ids=out, handle=h, finish_reason="stop", timings=timings)

    def generate_stream(self, messages: Sequence[Any], **kwargs: Any) -> TokenStream:
        result = self.generate(messages, **kwargs)

        def chunks() -> Any:
            for word in result.text.split(" "):
                yield StreamChunk(text=word + " " if word != result.text.split(" ")[-1] else word, token_ids=[])
            return result

        return TokenStream(chunks())

    def register_agent(self, name: str, fixed_prompt: Any, *, prefill: bool = False) -> AgentInfo:
        self.agents[name] = fixed_prompt
        return AgentInfo(name=name, fixed_tokens=len(fixed_prompt))

    def hints(self, steps: Any, *, running: Iterable[str] = (), finished: Iterable[str] = ()) -> dict[str, float]:
        running, finished = tuple(running), tuple(finished)
        ste = steps.steps_to_execution(running, finished) if hasattr(steps, "steps_to_execution") else dict(steps)
        self.hint_calls.append((running, finished, ste))
        return ste

    def release(self, handles: Any) -> None:
        items = [handles] if isinstance(handles, Handle | str) else list(handles)
        self.released.update(getattr(h, "id", h) for h in items)


class State(TypedDict):
    messages: Annotated[list, add_messages]
    rounds: int


def build_graph(call: Any, rounds: int = 2) -> Any:
    """The supervisor-style graph; ``call(name, messages) -> message`` makes each LLM call."""
    from langchain_core.messages import HumanMessage
    from langgraph.graph import END, START, StateGraph

    def agent(name: str) -> Any:
        def node(state: State) -> dict[str, Any]:
            ask = HumanMessage(f"{name}: continue.")
            return {"messages": [ask, call(name, [*state["messages"], ask])]}

        return node

    def planner(state: State) -> dict[str, Any]:
        return {**agent("planner")(state), "rounds": state.get("rounds", 0) + 1}

    g = StateGraph(State)
    g.add_node("planner", planner)
    for name in ("researcher", "coder", "reviewer", "summarizer"):
        g.add_node(name, agent(name))
    g.add_edge(START, "planner")
    g.add_conditional_edges("planner", lambda s: ["researcher", "coder"])  # wildcard: learned at run time
    g.add_edge(["researcher", "coder"], "reviewer")
    g.add_conditional_edges("reviewer", lambda s: "again" if s["rounds"] < rounds else "done",
                            {"again": "planner", "done": "summarizer"})
    g.add_edge("summarizer", END)
    return g.compile()


LLM_CALLS_PER_RUN = 9  # 2 rounds x (planner, researcher, coder, reviewer) + summarizer


def run(repeats: int = 200) -> dict[str, Any]:
    from kvbaton.adapters.langgraph import KvbatonChatModel, wrap
    from kvbaton.adapters.langgraph.chat_model import to_chat
    from langchain_core.messages import AIMessage, SystemMessage

    client = InstantClient("fine, next")

    def direct(name: str, messages: list[Any]) -> Any:
        result = client.generate(to_chat(messages), max_tokens=8)
        return AIMessage(result.text)

    model = KvbatonChatModel(client=client, max_tokens=8)

    def via_model(name: str, messages: list[Any]) -> Any:
        return model.invoke(messages)

    apps = {"direct": build_graph(direct), "model": build_graph(via_model)}
    apps["wrapped"] = wrap(build_graph(via_model), client)
    inputs = {"messages": [SystemMessage("You are a team of agents."), ("user", "Plan a trip.")], "rounds": 0}
    times: dict[str, list[float]] = {k: [] for k in apps}
    for name, app in apps.items():  # warm up
        app.invoke(inputs)
    for _ in range(repeats):
        for name, app in apps.items():  # interleaved, so drift hits every variant alike
            t = time.perf_counter()
            app.invoke(inputs)
            times[name].append(time.perf_counter() - t)
    rows = [measured({"variant": k}, "ms_per_call", [t / LLM_CALLS_PER_RUN * 1e3 for t in v]) for k, v in times.items()]
    per_call = {r["variant"]: r["ms_per_call"] for r in rows}
    hints_per_run = len(client.hint_calls) / (repeats + 1)
    return {
        "benchmark": "adapter_overhead",
        "rows": rows,
        "repeats": repeats,
        "llm_calls_per_run": LLM_CALLS_PER_RUN,
        "hints_per_run": hints_per_run,
        "ms_per_call": per_call,
        "overhead_ms_per_call": {
            "model_vs_direct": per_call["model"] - per_call["direct"],
            "wrap_vs_model": per_call["wrapped"] - per_call["model"],
            "adapter_total": per_call["wrapped"] - per_call["direct"],
        },
    }


def table(payload: dict[str, Any]) -> str:
    from kvbaton.bench.common import format_table  # torch, which the adapter tests using this module do not need

    return format_table(["variant", "ms per LLM call (graph time / calls)"],
                        [[r["variant"], cell(r, "ms_per_call")] for r in payload["rows"]])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench adapter_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200,
                        help="timed graph runs per variant (all kept; median [min–max] reported)")
    from kvbaton.bench import record

    record.add_arguments(parser, "adapter_overhead")
    args = parser.parse_args(argv)
    with record.Recording.from_args("adapter_overhead", args, argv) as rec:
        payload = run(args.repeats)
        path = rec.write(payload)
    print(table(payload))
    o = payload["overhead_ms_per_call"]
    print(f"\nadapter overhead per LLM call: {o['adapter_total']:.3f} ms "
          f"(chat model {o['model_vs_direct']:.3f} ms + wrap/hints {o['wrap_vs_model']:.3f} ms; "
          f"{payload['hints_per_run']:.0f} hints per run); target <= 2 ms")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
