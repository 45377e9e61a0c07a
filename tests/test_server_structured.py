"""Structured output, tools and log probabilities over HTTP: the ``openai`` SDK, LangChain's
``ChatOpenAI`` (``with_structured_output``, ``bind_tools``), an AutoGen agent with a tool, and
kvbaton's own HTTP client, all against the one shared real ``kvbaton serve``."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from kvbaton import InvalidRequest, connect
from typing_extensions import TypedDict

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
    "required": ["city", "temp"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Weather in Paris as JSON"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oa(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_response_format_json_schema_gives_json_valid_for_the_schema(oa):
    done = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}})
    value = json.loads(done.choices[0].message.content)
    assert set(value) == {"city", "temp"} and isinstance(value["temp"], int)
    assert done.choices[0].finish_reason == "stop"


def test_chat_logprobs_whole_and_streamed(oa):
    done = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, logprobs=True, top_logprobs=2)
    content = done.choices[0].logprobs.content
    assert "".join(t.token for t in content) == done.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)  # greedy
    assert content[0].bytes == list(content[0].token.encode())
    chunks = list(oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, logprobs=True, top_logprobs=2,
                                             stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_have_the_legacy_shape(oa):
    done = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, logprobs=2)
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.token_logprobs) == 3
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(3)]
    assert all(len(alts) == 2 and max(alts, key=alts.get) == tok for tok, alts in zip(lp.tokens, lp.top_logprobs))
    chunks = list(oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, logprobs=2,
                                        stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp_ in streamed for t in lp_.tokens] == lp.tokens
    assert [o for lp_ in streamed for o in lp_.text_offset] == lp.text_offset


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_tool_choice_gives_a_tool_call(oa, choice):
    done = oa.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, tools=TOOLS, tool_choice=choice)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls" and message.content is None
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(oa.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, tools=TOOLS,
                                             tool_choice=choice, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert {tc.index for tc in streamed} == {0} and [tc.function.name for tc in streamed if tc.function.name] == [
        "get_weather"]
    assert "".join(tc.function.arguments or "" for tc in streamed) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_result_round_trips_and_bad_tool_requests_are_refused(oa):
    openai = pytest.importorskip("openai")
    call = oa.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, tools=TOOLS,
                                      tool_choice="required").choices[0].message.tool_calls[0]
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    answer = oa.chat.completions.create(model=MODEL, messages=history, max_tokens=12, tools=TOOLS)
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > 100  # the tool block is in the prompt
    none = oa.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, tools=TOOLS, tool_choice="none")
    assert none.usage.prompt_tokens < 50 and none.choices[0].message.tool_calls is None  # "none": tools not shown
    for bad in [{"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tool_choice": "required", "tools": None},
                {"tool_choice": "required", "response_format": {"type": "json_object"}},
                {"response_format": {"type": "json_schema"}},
                {"top_logprobs": 2}]:
        with pytest.raises(openai.BadRequestError) as err:
            oa.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **{"tools": TOOLS, **bad})
        assert err.value.body["code"] == "invalid_request"


def test_langchain_structured_output_and_bind_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        temp: int

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_tokens=40,
                                      temperature=0, max_retries=0)
    weather = llm.with_structured_output(Weather).invoke("Weather in Paris as JSON")
    assert isinstance(weather, Weather) and weather.city

    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        return "sunny"

    answer = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("get_weather", {"city": "Paris"})]


class Router(TypedDict):
    """Worker to route to next. If no workers needed, route to FINISH."""

    next: Literal["researcher", "coder", "FINISH"]


def test_langchain_default_structured_output_of_a_typed_dict_stops(server):
    """The LangGraph supervisor tutorial's router, as written: ``with_structured_output`` of a TypedDict
    sends its schema without ``additionalProperties`` (and ``strict: false``); compiled strictly, the
    answer ends with ``stop`` and parses, instead of growing keys until ``max_tokens``."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_tokens=60,
                                      temperature=0, max_retries=0)
    system = ("You are a supervisor tasked with managing a conversation between the following workers: "
              "researcher, coder. Given the following user request, respond with the worker to act next. When "
              "finished, respond with FINISH.")
    out = llm.with_structured_output(Router, include_raw=True).invoke(
        [("system", system), ("human", "Find the population of Paris, then plot it.")])
    assert out["parsing_error"] is None and set(out["parsed"]) == {"next"}
    assert out["raw"].response_metadata["finish_reason"] == "stop"


def test_autogen_agent_calls_its_tool(server):
    pytest.importorskip("autogen_ext.models.openai")
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.messages import ToolCallSummaryMessage
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    calls: list[str] = []

    async def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        calls.append(city)
        return f"18 degrees in {city}"

    class RequiresATool(OpenAIChatCompletionClient):
        """The agent asks with tool_choice "auto"; a 135M model does not call tools on its own, so this
        client requires a call whenever tools are offered (enforced by the server's constrained decoding)."""

        async def create(self, messages, *, tools=(), tool_choice="auto", **kwargs):  # type: ignore[override]
            return await super().create(messages, tools=tools, tool_choice="required" if tools else tool_choice,
                                        **kwargs)

    async def main() -> None:
        client = RequiresATool(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_tokens=40,
                               temperature=0, model_info={"vision": False, "function_calling": True,
                                                          "json_output": True, "family": "unknown",
                                                          "structured_output": True})
        try:
            agent = AssistantAgent("forecaster", model_client=client, tools=[get_weather])
            result = await agent.run(task="What is the weather in Paris?")
        finally:
            await client.close()
        assert calls == ["Paris"]
        assert isinstance(result.messages[-1], ToolCallSummaryMessage)
        assert "18 degrees in Paris" in result.messages[-1].content

    asyncio.run(main())


def test_kvbaton_http_client_response_format_and_logprobs(server):
    with connect(server.url) as client:
        result = client.generate(ASK, max_tokens=40, logprobs=True, response_format={
            "type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}})
        assert set(json.loads(result.text)) == {"city", "temp"}
        assert [e.token_id for e in result.logprobs] == result.token_ids
        chunks = list(client.generate_stream(ASK, max_tokens=3, logprobs=True))
        assert [e.token_id for c in chunks for e in c.logprobs] == [t for c in chunks for t in c.token_ids]
        with pytest.raises(InvalidRequest):
            client.generate(ASK, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})
        client.release([result.handle])
