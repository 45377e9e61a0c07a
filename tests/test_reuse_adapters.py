"""The adapters' reuse policy (``"auto"`` by default) and how their replies say whether they are exact:
LangChain ``AIMessage.response_metadata["kvbaton"]``, AutoGen ``KvbatonCreateResult.kvbaton`` and the
stamped ``metadata["kvbaton_exact"]``, mode 2's ``X-Kvbaton-Reuse`` / ``X-Kvbaton-Approximate``.
The real engine (one per module), a ~250-token document per test, greedy, 4 tokens per answer.

Whether ``auto`` approximates or falls back to dense prefill depends on the next-token margin, so
the marking checks use ``rotate`` (never falls back); ``auto`` is checked to have found the span.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Annotated, Any

import httpx
import pytest

pytest.importorskip("langgraph")
pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent
from autogen_core.models import SystemMessage as AgSystem
from autogen_core.models import UserMessage
from autogen_ext.models.replay import ReplayChatCompletionClient
from conftest import dense_greedy
from kvbaton.adapters import core
from kvbaton.adapters.autogen import KvbatonChatCompletionClient, KvbatonCreateResult, instrument
from kvbaton.adapters.langgraph import KvbatonChatModel
from kvbaton.adapters.langgraph.chat_model import ACTIVE_RUN
from kvbaton.adapters.langgraph.openai_dropin import CallTag, _after, _target
from kvbaton.bench.corpus import document
from kvbaton.embedded import EmbeddedClient
from langchain_core.messages import HumanMessage, SystemMessage
from typing_extensions import TypedDict

MAX_TOKENS = 4


class MapReduce(TypedDict):
    done: Annotated[list[int], operator.add]  # the turns done (the Send branches' writes are added up)


@pytest.fixture(scope="module")
def kv() -> Iterator[EmbeddedClient]:
    from kvbaton.backend import Engine

    engine = Engine(kv_budget="128MiB")
    yield EmbeddedClient(engine=engine)
    engine.close()


def check(report: dict[str, Any]) -> None:
    """The marks of one reply agree with each other."""
    assert set(report) == {"exact", "tokens_reused", "tokens_approximate", "tokens_prefilled", "segments"}
    assert report["exact"] == (report["tokens_approximate"] == 0)
    assert report["tokens_approximate"] <= report["tokens_reused"]


# -- LangChain ----------------------------------------------------------------------------------------


def test_langchain_model_reuses_auto_by_default_and_marks_its_replies(kv):
    doc = document(160, seed=11)

    def ask(model: KvbatonChatModel, role: str, **kwargs: Any) -> Any:
        return model.invoke([SystemMessage(f"You are the {role}. Be brief."), HumanMessage(doc)], **kwargs)

    reader = KvbatonChatModel(client=kv, max_tokens=MAX_TOKENS, agent="lc-reader")
    assert reader.reuse == "auto"
    first = ask(reader, "reader")
    check(first.response_metadata["kvbaton"])
    assert first.response_metadata["kvbaton"]["exact"]

    # the default ("auto") finds the reader's document behind the reviewer's own system prompt
    auto = ask(KvbatonChatModel(client=kv, max_tokens=MAX_TOKENS, agent="lc-reviewer"), "reviewer")
    report = auto.response_metadata["kvbaton"]
    check(report)
    assert report["segments"] and report["segments"][0]["outcome"] in ("blended", "recomputed", "rotated", "exact")

    rotate = KvbatonChatModel(client=kv, max_tokens=MAX_TOKENS, agent="lc-critic", reuse="rotate")
    reply = ask(rotate, "critic")
    report = reply.response_metadata["kvbaton"]
    check(report)
    assert not report["exact"] and report["tokens_approximate"] > 0
    assert report["segments"][0]["outcome"] == "rotated" and not report["segments"][0]["exact"]
    # cache_read counts exact reuse only (as the server's cached_tokens)
    assert (reply.usage_metadata["input_token_details"]["cache_read"]
            == report["tokens_reused"] - report["tokens_approximate"])
    assert reply.usage_metadata["input_tokens"] == report["tokens_reused"] + report["tokens_prefilled"]

    # per call: invoke(..., reuse="exact"); and on the model
    exact = ask(rotate, "editor", reuse="exact").response_metadata["kvbaton"]
    assert exact["exact"] and exact["segments"] == [] and exact["tokens_approximate"] == 0
    exact = ask(KvbatonChatModel(client=kv, max_tokens=MAX_TOKENS, reuse="exact"), "judge").response_metadata["kvbaton"]
    assert exact["exact"] and exact["segments"] == []

    # streams: the last chunk carries the marks
    chunks = list(KvbatonChatModel(client=kv, max_tokens=MAX_TOKENS, agent="lc-scribe", reuse="rotate").stream(
        [SystemMessage("You are the scribe. Be brief."), HumanMessage(doc)]
    ))
    report = chunks[-1].response_metadata["kvbaton"]
    check(report)
    assert not report["exact"]


def test_map_reduce_reducer_answers_as_dense_prefill_or_recomputes(kv, reference):
    """Issue 40's repro: a LangGraph ``Send`` fan-out of 4 summaries of the parts of one document into a
    reducer over the whole document, on ``KvbatonChatModel`` (``reuse="auto"``). The reducer's document is
    stitched from 4 spans read behind other prompts: a part placed far from where its source read it is
    prefilled (its K/V never saw the parts before it; re-aligned, such parts flipped the first token), and the
    reducer's first token is dense prefill's."""
    from kvbaton.bench.workloads import mapreduce
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    wl = mapreduce(seed=1, doc_tokens=480, parts=4)
    summarizer = KvbatonChatModel(client=kv, max_tokens=8, agent="mr-summarizer")
    reducer = KvbatonChatModel(client=kv, max_tokens=1, agent="mr-reducer")
    outputs: dict[int, str] = {}
    last = len(wl.turns) - 1

    def summarize(payload: dict[str, int]) -> dict[str, list[int]]:
        outputs[payload["index"]] = str(summarizer.invoke(wl.messages(payload["index"], [])).content)
        return {"done": [payload["index"]]}

    def reduce(state: MapReduce) -> dict[str, list[int]]:
        reply = reducer.invoke(wl.messages(last, [outputs[i] for i in range(last)]))
        outputs[last], report[0] = str(reply.content), reply.response_metadata["kvbaton"]
        return {"done": [last]}

    report: list[dict[str, Any]] = [{}]
    graph = StateGraph(MapReduce)
    graph.add_node("summarize", summarize)
    graph.add_node("reduce", reduce)
    graph.add_conditional_edges(START, lambda state: [Send("summarize", {"index": i}) for i in range(last)],
                                ["summarize"])
    graph.add_edge("summarize", "reduce")
    graph.add_edge("reduce", END)
    graph.compile().invoke({"done": []})

    placed = report[0]["segments"]
    assert len(placed) >= 3  # the document's parts, each from the summarizer turn that read it
    prompt = kv.chat_tokens(wl.messages(last, [outputs[i] for i in range(last)]))
    (first,), _ = dense_greedy(reference, prompt, 1)
    assert outputs[last] == kv.detokenize([first])
    # The last part was read behind a persona only and sits behind the other three here: never re-aligned.
    assert "tokens of the context it attends to differ" in placed[-1]["reason"]
    assert placed[-1]["outcome"] == "recomputed"
    # Every other part was decided from its measured deviation: blended or prefilled, and said so.
    assert all(s["outcome"] in ("blended", "recomputed") and "layer-1 values" in s["reason"]
               for s in placed if "tokens of the context it attends to differ" not in s["reason"])
    assert report[0]["exact"] == all(s["outcome"] == "recomputed" for s in placed)


# -- AutoGen ----------------------------------------------------------------------------------------------


def test_autogen_client_reuses_auto_by_default_and_marks_its_results(kv):
    doc = document(160, seed=12)

    def prompt(role: str) -> list[Any]:
        return [AgSystem(content=f"You are the {role}. Be brief."), UserMessage(content=doc, source="user")]

    reader = KvbatonChatCompletionClient(kv, agent="ag-reader", max_tokens=MAX_TOKENS)
    assert reader.dump_component().config["reuse"] == "auto"
    first = asyncio.run(reader.create(prompt("reader")))
    assert isinstance(first, KvbatonCreateResult)
    check(first.kvbaton)
    assert first.kvbaton["exact"] and first.cached is False

    auto = asyncio.run(KvbatonChatCompletionClient(kv, agent="ag-reviewer", max_tokens=MAX_TOKENS).create(
        prompt("reviewer")
    ))
    check(auto.kvbaton)
    assert auto.kvbaton["segments"]

    critic = KvbatonChatCompletionClient(kv, agent="ag-critic", max_tokens=MAX_TOKENS, reuse="rotate")
    assert critic.dump_component().config["reuse"] == "rotate"
    rotated = asyncio.run(critic.create(prompt("critic")))
    check(rotated.kvbaton)
    assert not rotated.kvbaton["exact"] and rotated.kvbaton["segments"][0]["outcome"] == "rotated"
    assert critic.last_result is not None and critic.last_result.exact is False
    assert rotated.usage.prompt_tokens == rotated.kvbaton["tokens_reused"] + rotated.kvbaton["tokens_prefilled"]

    exact = asyncio.run(critic.create(prompt("editor"), extra_create_args={"reuse": "exact"}))
    assert exact.kvbaton["exact"] and exact.kvbaton["segments"] == []
    with pytest.raises(ValueError, match="unsupported extra_create_args"):
        asyncio.run(critic.create(prompt("editor"), extra_create_args={"handle": "x"}))


def test_autogen_instrumented_replies_are_stamped(kv):
    doc = document(160, seed=13)

    def assistant(name: str) -> AssistantAgent:
        return AssistantAgent(name, model_client=ReplayChatCompletionClient(["unused"]),
                              system_message=f"You are the {name}. Be brief.")

    reader, critic = assistant("stamp_reader"), assistant("stamp_critic")
    # two instrumented agents, two runs: one reuse session only because they name it (tests/test_reuse_scope.py)
    instrument(reader, kv, max_tokens=MAX_TOKENS, session="stamp")
    instrument(critic, kv, max_tokens=MAX_TOKENS, reuse="rotate", session="stamp")
    assert reader.kvbaton.model_clients["stamp_reader"].dump_component().config["reuse"] == "auto"

    meta = asyncio.run(reader.run(task=doc)).messages[-1].metadata
    assert meta["kvbaton_handle"] and meta["kvbaton_exact"] == "true" and meta["kvbaton_tokens_approximate"] == "0"
    meta = asyncio.run(critic.run(task=doc)).messages[-1].metadata
    assert meta["kvbaton_exact"] == "false" and int(meta["kvbaton_tokens_approximate"]) > 0


# -- shared pieces, no model ------------------------------------------------------------------------------


@pytest.mark.unit
def test_reuse_is_passed_only_where_taken_and_the_report():
    class Takes:
        def generate(self, messages: Any, *, reuse: str | None = None) -> None: ...

    class Older:
        def generate(self, messages: Any, **options: Any) -> None: ...

    assert core.reuse_kwargs(Takes().generate, "auto") == {"reuse": "auto"}
    assert core.reuse_kwargs(Older().generate, "auto") == {} and core.reuse_kwargs(Takes().generate, None) == {}

    segment = SimpleNamespace(outcome="rotated", tokens_reused=200, exact=False, reason="keys re-aligned")
    result = SimpleNamespace(exact=False, segments=[segment], timings=SimpleNamespace(
        tokens_reused=210, tokens_approximate=200, tokens_prefilled=30))
    assert core.reuse_report(result) == {
        "exact": False, "tokens_reused": 210, "tokens_approximate": 200, "tokens_prefilled": 30,
        "segments": [{"outcome": "rotated", "tokens_reused": 200, "exact": False, "reason": "keys re-aligned"}],
    }


@pytest.mark.unit
def test_openai_dropin_sends_the_policy_and_reads_the_mark():
    wrapper = SimpleNamespace(base_url="http://kv.test/v1", reuse="auto", redirect_openai=False, token=None)
    token = ACTIVE_RUN.set(SimpleNamespace(wrapper=wrapper))
    try:
        request = httpx.Request("POST", "http://kv.test/v1/chat/completions")
        found = _target(request)
        assert request.headers["x-kvbaton-reuse"] == "auto"
        other = httpx.Request("POST", "http://elsewhere.test/v1/chat/completions")
        assert _target(other) is None and "x-kvbaton-reuse" not in other.headers
    finally:
        ACTIVE_RUN.reset(token)

    def answer(headers: dict[str, str]) -> CallTag:
        tag = CallTag("critic")
        _after((found, tag), httpx.Response(200, headers=headers))
        return tag

    tag = answer({"content-type": "application/json", "x-kvbaton-handle": "h1", "x-kvbaton-approximate": "true"})
    assert tag.handle == "h1" and tag.exact is False
    assert answer({"content-type": "application/json", "x-kvbaton-handle": "h2"}).exact is True
    # a stream: the server computes its prompt before it answers, so its headers say it too
    assert answer({"content-type": "text/event-stream", "x-kvbaton-approximate": "true"}).exact is False
    assert answer({"content-type": "text/event-stream"}).exact is True
    assert CallTag("critic").exact is None  # no answer yet
