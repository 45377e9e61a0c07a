"""Structured output, tools and log probabilities on the embedded engine: a response format is
enforced while decoding (valid JSON for a schema), a required tool call comes out as a valid call,
tools and earlier calls reach a template that has no tool support, and log probabilities are the
model's own."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from kvbaton import Client, InvalidRequest, SamplingParams
from kvbaton.tools import parse_tool_calls, required_tools, tool_call_format

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
    "required": ["city", "temp"],
    "additionalProperties": False,
}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
ASK = [{"role": "user", "content": "Weather in Paris as JSON"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_json_schema_output_is_valid_json_for_the_schema(engine):
    client = Client(engine)
    free = client.generate(ASK, max_tokens=24)
    assert not free.text.startswith("{")  # unconstrained, the model writes a markdown fence
    result = client.generate(ASK, max_tokens=40, response_format=AS_SCHEMA)
    value = json.loads(result.text)
    assert set(value) == {"city", "temp"} and isinstance(value["city"], str) and isinstance(value["temp"], int)
    assert result.finish_reason == "stop"  # ended where the grammar accepts
    sampled = client.generate(ASK, max_tokens=40, response_format=AS_SCHEMA, temperature=0.9, top_k=20, top_p=0.9,
                              seed=3)
    assert set(json.loads(sampled.text)) == {"city", "temp"}  # the mask holds under sampling too


def test_json_object_and_text_formats(engine):
    client = Client(engine)
    age = client.generate([{"role": "user", "content": "Return Bob's age (30) in a JSON object."}], max_tokens=40,
                          response_format={"type": "json_object"})
    assert json.loads(age.text) == {"age": 30} and age.finish_reason == "stop"
    text = client.generate(ASK, max_tokens=6, response_format={"type": "text"})
    assert text.token_ids == client.generate(ASK, max_tokens=6).token_ids  # "text" constrains nothing


def test_output_cut_by_max_tokens_says_length(engine):
    result = Client(engine).generate(ASK, max_tokens=3, response_format=AS_SCHEMA)
    assert result.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)


def test_bad_formats_are_refused_before_any_block_is_taken(engine):
    client = Client(engine)
    with pytest.raises(InvalidRequest, match="response_format"):
        client.generate(ASK, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})
    with pytest.raises(InvalidRequest, match="json_schema"):
        client.generate(ASK, response_format={"type": "json_schema"})
    with pytest.raises(InvalidRequest):
        client.generate(ASK, response_format={"type": "yaml"})
    with pytest.raises(InvalidRequest, match="top_logprobs needs logprobs"):
        client.generate(ASK, top_logprobs=2)
    assert engine.stats().blocks_used == 0 and engine.stats().handles_live == 0


def test_constrained_and_unconstrained_requests_batched_together_are_both_right(engine):
    client = Client(engine)
    alone = client.generate(ASK, max_tokens=16, ignore_eos=True)
    results: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def run(name: str, **options: object) -> None:
        barrier.wait()
        results[name] = client.generate(ASK, **options)

    threads = [threading.Thread(target=run, args=("free",), kwargs={"max_tokens": 16, "ignore_eos": True}),
               threading.Thread(target=run, args=("json",), kwargs={"max_tokens": 40, "response_format": AS_SCHEMA})]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["free"].token_ids == alone.token_ids  # type: ignore[attr-defined]
    assert set(json.loads(results["json"].text)) == {"city", "temp"}  # type: ignore[attr-defined]


def test_logprobs_are_the_models_own_and_stream_with_their_tokens(engine):
    client = Client(engine)
    result = client.generate(ASK, max_tokens=5, logprobs=True, top_logprobs=3)
    assert [e.token_id for e in result.logprobs] == result.token_ids
    for entry in result.logprobs:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token_id == entry.token_id  # greedy: the chosen token is the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    streamed = [e for chunk in client.generate_stream(ASK, max_tokens=5, logprobs=True, top_logprobs=3)
                for e in chunk.logprobs]
    # (the second request reads the prompt's K/V from the prefix cache: equal up to rounding)
    assert [e.token_id for e in streamed] == result.token_ids
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in result.logprobs], abs=1e-4)
    assert client.generate(ASK, max_tokens=2).logprobs is None
    # under a constraint they are still the model's unconstrained distribution
    constrained = client.generate(ASK, max_tokens=2, response_format=AS_SCHEMA, logprobs=True, top_logprobs=1)
    assert constrained.logprobs[0].top_logprobs[0].token_id != constrained.token_ids[0]


def test_a_prompts_log_probabilities_are_the_dense_models_own(engine, reference):
    """``Engine.prompt_logprobs`` (echo + logprobs scoring): every token after the first with its log
    probability under transformers' own forward of the prompt, and the most likely tokens there."""
    import torch

    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    scored = engine.prompt_logprobs(prompt, top_logprobs=2)
    tokens = engine.tokenize(prompt)
    assert [e.token_id for e in scored] == tokens and scored[0].logprob is None and scored[0].top_logprobs == []
    with torch.no_grad():
        dense = torch.log_softmax(reference(torch.tensor([tokens])).logits[0, :-1].float(), dim=-1)
    assert [e.logprob for e in scored[1:]] == pytest.approx([float(dense[i, t]) for i, t in enumerate(tokens[1:])],
                                                            abs=1e-3)
    assert [e.top_logprobs[0].token_id for e in scored[1:]] == dense.argmax(-1).tolist()
    assert engine.stats().handles_live == 0  # nothing kept


def test_a_prompt_longer_than_a_scoring_chunk_is_scored_whole_as_the_dense_model_does(engine, reference, corpus_tokens):
    """Scoring computes at most SCORE_CHUNK rows of logits at a time, each chunk behind the K/V of those before:
    a prompt of several chunks gets the dense forward's log probabilities at every position, and leaves no
    block behind."""
    import torch
    from kvbaton.backend.reuse.compose import SCORE_CHUNK

    tokens = corpus_tokens[: 2 * SCORE_CHUNK + 77]
    used = engine.stats().blocks_used
    scored = engine.prompt_logprobs(tokens)
    assert [e.token_id for e in scored] == tokens and scored[0].logprob is None
    with torch.no_grad():
        dense = torch.log_softmax(reference(torch.tensor([tokens])).logits[0, :-1].float(), dim=-1)
    expected = dense.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()
    assert [e.logprob for e in scored[1:]] == pytest.approx(expected, abs=1e-3)
    assert engine.stats().handles_live == 0 and engine.stats().blocks_used == used


def test_a_required_tool_call_is_a_valid_call(engine):
    client = Client(engine)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    result = client.generate(ask, tools=TOOLS, max_tokens=40,
                             response_format=tool_call_format(required_tools(TOOLS, "required")))
    text, calls = parse_tool_calls(result.text, ["get_weather"])
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_tools_and_calls_reach_a_template_without_tool_support(engine):
    """SmolLM2's template ignores ``tools`` and ``tool_calls``: kvbaton's convention writes them."""
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    text = engine.detokenize(engine.chat_tokens(history, tools=TOOLS))
    assert '<tools>\n{"description": "Get the current weather of a city", "name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>18 C</tool_response><|im_end|>" in text
    assert engine.chat_tokens(ASK) == engine.chat_tokens(ASK, tools=None)  # no tools: the template as it is


def test_framework_adapters_enforce_required_calls_and_structured_output(engine):
    """The embedded path: kvbaton's LangChain model and AutoGen client constrain a required call
    (and LangChain's ``with_structured_output``, which requires one) and AutoGen's ``json_output``."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("autogen_core")
    from autogen_core.models import UserMessage
    from autogen_core.tools import FunctionTool
    from kvbaton.adapters.autogen import KvbatonChatCompletionClient
    from kvbaton.adapters.langgraph import KvbatonChatModel
    from pydantic import BaseModel

    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        return "sunny"

    class Weather(BaseModel):
        city: str
        temp: int

    model = KvbatonChatModel(client=Client(engine), max_tokens=40)
    answer = model.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("get_weather", {"city": "Paris"})]
    weather = model.with_structured_output(Weather).invoke("Weather in Paris as JSON")
    assert isinstance(weather, Weather) and weather.city == "Paris"

    async def main() -> None:
        client = KvbatonChatCompletionClient(Client(engine), max_tokens=40)
        tool = FunctionTool(get_weather, description="Get the current weather of a city.")
        called = await client.create([UserMessage(content="What is the weather in Paris?", source="user")],
                                     tools=[tool], tool_choice=tool)
        assert [(c.name, json.loads(c.arguments)) for c in called.content] == [("get_weather", {"city": "Paris"})]
        typed = await client.create([UserMessage(content="Weather in Paris as JSON", source="user")],
                                    json_output=Weather)
        assert Weather.model_validate_json(typed.content).city == "Paris"
        await client.close()

    asyncio.run(main())


# -- strict schemas, as vLLM's and SGLang's grammar backends compile them ------------------------------

OPEN_CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # LangChain's shape


@pytest.mark.unit
def test_schemas_compile_strictly_unless_they_say_otherwise():
    from kvbaton.backend.runtime.constrained import strict_schema

    nested = {"type": "object", "properties": {"inner": OPEN_CITY, "tags": {"type": "array", "items": OPEN_CITY},
                                               "free": {"type": "object", "additionalProperties": True},
                                               "pair": {"type": "array", "prefixItems": [{"type": "integer"}]}},
              "$defs": {"Ref": {"type": "object", "properties": {"x": {}}}}}
    strict = strict_schema(nested)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["inner"]["additionalProperties"] is False
    assert strict["properties"]["tags"]["items"]["additionalProperties"] is False
    assert strict["$defs"]["Ref"]["additionalProperties"] is False
    assert strict["properties"]["free"]["additionalProperties"] is True  # said explicitly: the opt-out
    assert strict["properties"]["pair"]["items"] is False
    assert "additionalProperties" not in nested and "additionalProperties" not in OPEN_CITY  # the caller's untouched
    assert strict_schema({"type": "object"}) == {"type": "object"}  # any object stays any object


def test_a_schema_that_leaves_other_keys_open_still_ends_with_its_own(engine):
    client = Client(engine)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": OPEN_CITY, "strict": False}}
    result = client.generate(ASK, max_tokens=60, response_format=fmt)
    assert result.finish_reason == "stop" and set(json.loads(result.text)) == {"city"}
    opened = {**OPEN_CITY, "additionalProperties": True}  # the opt-out: compiled as written
    free = client.generate(ASK, max_tokens=8, response_format={"type": "json_schema", "json_schema": {
        "name": "city", "schema": opened}})
    assert free.text.startswith('{"city"')


# A chat template with tool support of its own, the way Llama 3's renders tools and calls (JSON with
# "parameters"): the OpenAI route hands it the tools and the calls' arguments as objects.
LLAMA_STYLE = (
    "{%- if tools %}<|im_start|>system\nYou may call: {% for t in tools %}{{ t.function | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}{%- for m in messages %}{%- if m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<|python_tag|>{\"name\": \"{{ c.function.name }}\", \"parameters\": "
    "{{ c.function.arguments | tojson }}}{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def test_a_template_with_tool_support_renders_tools_and_calls_itself():
    from fastapi.testclient import TestClient
    from kvbaton.backend import Engine
    from kvbaton.backend.server import create_app

    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
               {"role": "user", "content": "And in Rome?"}]
    engine = Engine(kv_budget="64MiB", chat_template=LLAMA_STYLE)
    try:
        as_objects = [{**m, "content": "", "tool_calls": [  # as the route hands them over
            {**c, "function": {**c["function"], "arguments": {"city": "Paris"}}} for c in m["tool_calls"]]}
            if m.get("tool_calls") else m for m in history]
        rendered = engine.detokenize(engine.chat_tokens(as_objects, tools=TOOLS))
        assert 'You may call: {"name": "get_weather", "description": "Get the current weather of a city"' in rendered
        assert '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}' in rendered
        assert "<tools>" not in rendered and "<tool_call>" not in rendered  # not kvbaton's convention
        with TestClient(create_app(engine, max_tokens=64)) as http:
            body = {"messages": history, "tools": TOOLS, "max_tokens": 40}
            answer = http.post("/v1/chat/completions", json=body).json()
            assert answer["usage"]["prompt_tokens"] == len(engine.chat_tokens(as_objects, tools=TOOLS))
            forced = http.post("/v1/chat/completions", json={**body, "tool_choice": "required"}).json()
            [call] = forced["choices"][0]["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"]
    finally:
        engine.close()
