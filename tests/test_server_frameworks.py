"""Unmodified OpenAI-client frameworks against a real ``kvbaton serve``: LangChain's ``ChatOpenAI``
and AutoGen's ``OpenAIChatCompletionClient``, plus the ``openai`` SDK with ``extra_body``.
Nothing here counts tokens locally, so tiktoken never needs its (downloaded) encodings."""

from __future__ import annotations

import asyncio

import pytest

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a terse assistant. Notes: the blue team shipped the parser; the red team fixed three bugs."


def test_openai_sdk_with_kvbaton_extensions(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who fixed bugs?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=3, extra_headers={"X-Kvbaton-Agent": "sdk-agent"},
        extra_body={"kvbaton": {"step": "s1"}},
    )
    done = raw.parse()
    handle = raw.headers["x-kvbaton-handle"]
    assert done.model_extra["kvbaton"]["handle"] == handle and done.model_extra["kvbaton"]["agent"] == "sdk-agent"
    # the next call names that handle explicitly: the shared prompt is reused
    again = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, extra_body={"kvbaton": {"handle": handle}},
    )
    assert again.usage.prompt_tokens_details.cached_tokens >= done.usage.prompt_tokens - 1
    assert again.choices[0].message.content == done.choices[0].message.content  # greedy
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"kvbaton": {"handle": "0" * 32}})
    assert err.value.body["code"] == "handle_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100_000)


def test_langchain_chat_openai(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_tokens=4, temperature=0, max_retries=0,
    )
    messages = [("system", SYSTEM), ("human", "Which team shipped the parser?")]
    answer = llm.invoke(messages)
    assert isinstance(answer.content, str) and answer.content
    assert answer.usage_metadata["output_tokens"] <= 4
    streamed = list(llm.stream(messages))
    assert "".join(chunk.content for chunk in streamed) == answer.content


def test_autogen_openai_chat_completion_client(server):
    pytest.importorskip("autogen_ext.models.openai")
    from autogen_core.models import SystemMessage, UserMessage
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    async def main() -> None:
        client = OpenAIChatCompletionClient(
            model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_tokens=4, temperature=0,
            model_info={"vision": False, "function_calling": False, "json_output": False, "family": "unknown",
                        "structured_output": False},
        )
        try:
            result = await client.create([SystemMessage(content=SYSTEM),
                                          UserMessage(content="Which team fixed bugs?", source="user")])
            assert isinstance(result.content, str) and result.content
            assert result.finish_reason in ("stop", "length") and result.usage.completion_tokens <= 4
            pieces = [p async for p in client.create_stream([UserMessage(content="Say hi.", source="user")])]
            assert pieces and isinstance(pieces[-1].content, str)
        finally:
            await client.close()

    asyncio.run(main())


def test_wrapped_chat_openai_app_reuses_across_agents_by_default(server):
    """``wrap(app)`` is the opt-in: an unchanged ChatOpenAI app, each agent behind its own system prompt,
    reuses the notes another agent read (the adapter's policy, ``auto``, with no argument to ``wrap``
    nor ``--reuse`` on the server), and an answer served approximately says so."""
    langchain_openai = pytest.importorskip("langchain_openai")
    pytest.importorskip("langgraph")
    from typing import Annotated, Any, TypedDict

    from kvbaton.adapters.langgraph import KVBATON_KEY, wrap
    from kvbaton.bench.corpus import document
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langgraph.graph import add_messages
    from langgraph_apps import chain

    State = TypedDict("State", {"messages": Annotated[list, add_messages]})  # evaluated here: its hints resolve

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_tokens=4,
                                      temperature=0, max_retries=0, timeout=120)

    def agent(system: str, ask: str) -> Any:
        def node(state: Any) -> dict[str, Any]:
            question = HumanMessage(ask)
            return {"messages": [question, llm.invoke([SystemMessage(system), *state["messages"], question])]}

        return node

    app = wrap(chain(State, {"reader": agent("You are the reader. Summarize the notes.", "Summarize."),
                             "reviewer": agent("You are a strict reviewer of risks.", "Risk?")}).compile())
    assert app.reuse == "auto"
    with server.http() as http:
        before = http.get("/v1/kv/stats").json()["tokens_approximate"]
        out = app.invoke({"messages": [HumanMessage(f"Notes:\n{document(160, seed=21)}")]})
        after = http.get("/v1/kv/stats").json()["tokens_approximate"]
    reader, reviewer = [m for m in out["messages"] if isinstance(m, AIMessage)]
    assert reader.response_metadata[KVBATON_KEY]["exact"]
    # the reviewer's prompt: its own system prompt, then the notes the reader's handle holds
    assert after - before > 0
    assert reviewer.response_metadata[KVBATON_KEY]["exact"] is False
    app.release()
