"""The agents benchmark's shapes over HTTP: a workload through ``kvbaton serve`` with the OpenAI client,
and the map-reduce as a LangGraph app whose nodes call an unchanged ``ChatOpenAI``, ``wrap(app)``-ed.

- ``via == "openai"`` (``debate_openai``): every turn is ``POST /v1/chat/completions`` of the official
  ``openai`` client, tagged ``X-Kvbaton-Agent`` and ``X-Kvbaton-Session`` (one session per workload
  run), its policy as ``X-Kvbaton-Reuse``; the server manages the handles (each agent's latest is
  retained in the session and resumed by its next turn; the session is deleted at the end).
- ``via == "langgraph"`` (``mapreduce_langgraph``): the map-reduce as a LangGraph ``StateGraph``, a
  ``Send`` fan-out of the summarizer turns (run concurrently by LangGraph, so the server batches them)
  into the reducer; the nodes call ``langchain_openai.ChatOpenAI`` on the server as an app's author
  writes it, and the app is wrapped with ``kvbaton.adapters.langgraph.wrap(app, base_url=..., reuse=...)``
  (mode 2: the wrapper tags agents and the run's session). Each node builds its prompt with the
  workload's :meth:`~kvbaton.bench.workloads.Workload.messages`, so the prompts are the embedded
  variants' (and teacher forcing works the same).

One server per variant run (:func:`served`), started cold (its prefix cache empty) and stopped after;
``text`` runs on a server without a prefix cache. Turn records are those of
:func:`kvbaton.bench.agents.turn_record`: tokens from the answer's ``kvbaton`` field (openai) or from the
server's request events, found by the handle each reply carries (langgraph: the app sees LangChain
messages only); the generated token ids are the tokenizer's of the reply text (an OpenAI answer carries
none). Times include the HTTP round trips.
"""

from __future__ import annotations

import operator
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Any

import httpx
from kvbaton.bench.processes import start_kvbaton_serve, stop_process
from kvbaton.bench.workloads import Workload, run_workload
from typing_extensions import TypedDict

STARTUP_TIMEOUT_S = 300.0


@contextmanager
def served(dtype: str, kv_budget: str, prefix_cache: bool = True) -> Iterator[str]:
    """A ``kvbaton serve`` on loopback for one variant run (its URL), stopped at the end."""
    flags = ["--kv-budget", kv_budget, "--dtype", dtype, *([] if prefix_cache else ["--no-prefix-cache"]),
             "--served-model-name", "x"]  # the name this benchmark's requests give (the server refuses others)
    proc, url = start_kvbaton_serve(*flags, timeout=STARTUP_TIMEOUT_S)
    try:
        yield url
    finally:
        stop_process(proc, 30)


def warm_up(url: str, prompt: str, max_tokens: int) -> None:
    """The benchmark's warm-up request, on this server (released at once)."""
    r = httpx.post(f"{url}/v1/completions", json={"model": "x", "prompt": prompt, "max_tokens": max_tokens,
                                                  "ignore_eos": True}, timeout=600)
    r.raise_for_status()


def _headers(agent: str, session: str, variant: str) -> dict[str, str]:
    headers = {"X-Kvbaton-Agent": agent, "X-Kvbaton-Session": session}
    if variant != "text":
        headers["X-Kvbaton-Reuse"] = variant
    return headers


def _record(index: int, agent: str, seconds: float, text: str, tokens: list[int], timings: dict[str, Any],
            segments: Sequence[str]) -> dict[str, Any]:
    approx = int(timings.get("tokens_approximate") or 0)
    reused, prefilled = int(timings["tokens_reused"]), int(timings["tokens_prefilled"])
    return {
        "index": index, "agent": agent, "seconds": seconds, "ttft_s": timings.get("ttft_s"),
        "prompt_tokens": reused + prefilled, "reused_exact": reused - approx, "reused_approx": approx,
        "prefilled": prefilled, "generated": len(tokens), "exact": approx == 0,
        "discarded": int(timings.get("tokens_discarded") or 0), "segments": dict(Counter(segments)),
        "token_ids": tokens, "text": text,
    }


def run_openai(url: str, variant: str, wl: Workload, max_tokens: int, tokenize: Callable[[str], list[int]],
               teacher: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One run of ``wl`` through the server's OpenAI route with the ``openai`` client; its turn records."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    session = f"agents-{uuid.uuid4().hex[:12]}"
    turns: list[dict[str, Any]] = []

    def fn(agent: str, messages: list[dict[str, str]]) -> str:
        start = time.perf_counter()
        answer = client.chat.completions.create(
            model="x", messages=messages, max_tokens=max_tokens, temperature=0,  # type: ignore[arg-type]
            extra_headers=_headers(agent, session, variant), extra_body={"ignore_eos": True})
        seconds = time.perf_counter() - start
        ext = (answer.model_extra or {})["kvbaton"]
        text = answer.choices[0].message.content or ""
        turns.append(_record(len(turns), agent, seconds, text, tokenize(text)[:max_tokens], ext["timings"][0],
                             [s["outcome"] for s in ext["segments"]]))
        return text

    try:
        run_workload(wl, fn, teacher=teacher)
    finally:
        httpx.delete(f"{url}/v1/sessions/{session}", timeout=60)
        client.close()
    return turns


def run_langgraph(url: str, variant: str, wl: Workload, max_tokens: int, tokenize: Callable[[str], list[int]],
                  teacher: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One run of a map-reduce ``wl`` as a wrapped LangGraph app on ``ChatOpenAI``; its turn records."""
    from kvbaton.adapters.langgraph import wrap
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    llm = ChatOpenAI(model="x", base_url=f"{url}/v1", api_key="unused", max_tokens=max_tokens,  # type: ignore[arg-type]
                     temperature=0, max_retries=0, timeout=600, extra_body={"ignore_eos": True})
    maps = [i for i, t in enumerate(wl.turns) if t.part is not None]
    reducer = len(wl.turns) - 1
    replies: dict[int, tuple[str, str | None, float]] = {}  # turn -> (text, handle id, seconds)

    def ask(index: int, outputs: Sequence[str]) -> None:
        start = time.perf_counter()
        reply = llm.invoke(wl.messages(index, outputs))
        handle = (reply.additional_kwargs.get("kvbaton") or {}).get("handle", {}).get("id")
        replies[index] = (str(reply.content), handle, time.perf_counter() - start)

    def fan_out(state: _MapReduceState) -> list[Any]:  # Send to each summarizer turn
        return [Send("summarize", {"index": i}) for i in maps]

    def summarize(payload: dict[str, int]) -> dict[str, list[int]]:
        ask(payload["index"], teacher or [])
        return {"done": [payload["index"]]}

    def reduce(state: _MapReduceState) -> dict[str, list[int]]:
        ask(reducer, teacher or [replies[i][0] for i in range(reducer)])
        return {"done": [reducer]}

    graph = StateGraph(_MapReduceState)
    graph.add_node("summarize", summarize)
    graph.add_node("reduce", reduce)
    graph.add_conditional_edges(START, fan_out, ["summarize"])
    graph.add_edge("summarize", "reduce")
    graph.add_edge("reduce", END)
    app = wrap(graph.compile(), base_url=url, reuse=None if variant == "text" else variant)
    since = httpx.get(f"{url}/v1/kv/events", params={"since": 0}, timeout=60).json()["next"]
    app.invoke({"done": []})
    events = httpx.get(f"{url}/v1/kv/events", params={"since": since}, timeout=60).json()["events"]
    by_handle = {e["handle_out"]: e for e in events if e["kind"] == "request" and e.get("handle_out")}
    turns = []
    for index, turn in enumerate(wl.turns):
        text, handle, seconds = replies[index]
        e = by_handle.get(handle) or {}
        timings = {"tokens_reused": e.get("tokens_reused", 0), "tokens_prefilled": e.get("tokens_prefilled", 0),
                   "tokens_approximate": e.get("tokens_approximate", 0),
                   "ttft_s": (e["t_first_token"] - e["t_queued"]) if e.get("t_first_token") else None}
        turns.append(_record(index, turn.agent, seconds, text, tokenize(text)[:max_tokens], timings, []))
    return turns


class _MapReduceState(TypedDict):
    done: Annotated[list[int], operator.add]  # the turns done (the Send branches' writes are added up)


RUNNERS: dict[str, Callable[..., list[dict[str, Any]]]] = {"openai": run_openai, "langgraph": run_langgraph}


def run_served(url: str, variant: str, wls: Sequence[Workload], max_tokens: int,
               tokenize: Callable[[str], list[int]], teachers: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Every workload of ``wls`` (all over HTTP) once on the server at ``url``: seconds and turn records, as
    :func:`kvbaton.bench.agents.run_variant` gives them."""
    out: dict[str, Any] = {}
    for wl in wls:
        start = time.perf_counter()
        turns = RUNNERS[wl.via](url, variant, wl, max_tokens, tokenize,
                                None if teachers is None else teachers[wl.name])
        # (the server's fidelity audit runs in its own process: none of its forwards are counted here)
        out[wl.name] = {"seconds": time.perf_counter() - start, "turns": turns, "background_forwards": 0}
    return out
