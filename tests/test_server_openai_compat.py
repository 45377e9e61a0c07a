"""What OpenAI's own client and types expect of every OpenAI answer of ``kvbaton serve`` (issue 49):
each answer validated against the ``openai`` package's models (``openai.types``, no field they lack),
a required tool call cut by ``max_tokens`` answered as OpenAI and vLLM answer it, unknown models 404,
OpenAI's error types, ``/v1/responses`` streamed as its typed events, ``echo`` on completions; and the
request fields the server knows checked against the ``openai`` package's typed params. One shared
server (``server``: max_tokens capped at 64)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from openai_shapes import check, sse_events
from pydantic import TypeAdapter

MODEL = "smollm2-135m-instruct"
JOKE = {"type": "function", "function": {
    "name": "Joke", "description": "A joke to tell",
    "parameters": {"type": "object", "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}},
                   "required": ["setup", "punchline"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK_JOKE = [{"role": "user", "content": "Tell me a joke about cats"}]
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def oa(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


def _stream(http, path: str, body: dict) -> list[tuple[str | None, str]]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.read().decode())


# -- a required tool call cut by max_tokens ----------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "Joke"}}])
def test_a_required_call_cut_by_max_tokens_is_a_partial_call_with_finish_reason_length(oa, http, tool_choice):
    body = {"model": MODEL, "messages": ASK_JOKE, "tools": [JOKE], "tool_choice": tool_choice, "max_tokens": 12}
    whole = check(http.post("/v1/chat/completions", json=body).json(), ChatCompletion)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "Joke" and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):  # cut short: the arguments as far as they were written, not valid JSON
        json.loads(call.function.arguments)

    events = _stream(http, "/v1/chat/completions", body)
    chunks = [check(data, ChatCompletionChunk) for _, data in events if data != "[DONE]"]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # no content: the call is the answer
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert [tc.function.name for tc in calls if tc.function.name] == ["Joke"] and {tc.index for tc in calls} == {0}
    assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_a_whole_required_call_streams_to_the_whole_answer(oa):
    done = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                      tools=[WEATHER], tool_choice="required", max_tokens=40)
    [call] = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == {"city": "Paris"}


# -- models and errors -------------------------------------------------------------------------------------


def test_an_unknown_model_is_404_model_not_found_on_every_route(oa, http):
    for call in (lambda: oa.chat.completions.create(model="gpt-4o", messages=ASK_JOKE, max_tokens=1),
                 lambda: oa.completions.create(model="gpt-4o", prompt="Hi", max_tokens=1),
                 lambda: oa.responses.create(model="gpt-4o", input="Hi", max_output_tokens=1),
                 lambda: oa.models.retrieve("gpt-4o")):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert (err.value.code, err.value.type, err.value.param) == ("model_not_found", "invalid_request_error",
                                                                      "model")
    listed = [check(m, Model) for m in http.get("/v1/models").json()["data"]]
    assert [m.id for m in listed] == [MODEL] and check(http.get(f"/v1/models/{MODEL}").json(), Model).id == MODEL
    # OpenAI's types are not by status: a 404 of an unknown route and a 410 are the request's errors too
    assert http.post("/v1/kv/release", json={"handles": ["0" * 32]}).json()["error"]["type"] == "invalid_request_error"


# -- shapes of every answer ----------------------------------------------------------------------------------


def test_chat_and_completion_answers_have_openai_shapes_whole_and_streamed(http):
    chat = {"model": MODEL, "messages": ASK_JOKE, "max_tokens": 3, "n": 2, "logprobs": True, "top_logprobs": 1,
            "stream_options": {"include_usage": True}}
    whole = dict(chat)
    whole.pop("stream_options")
    assert len(check(http.post("/v1/chat/completions", json=whole).json(), ChatCompletion).choices) == 2
    chunks = [check(d, ChatCompletionChunk) for _, d in _stream(http, "/v1/chat/completions", chat) if d != "[DONE]"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    completion = {"model": MODEL, "prompt": ["Once upon", "In a land"], "max_tokens": 3, "logprobs": 1}
    assert len(check(http.post("/v1/completions", json=completion).json(), Completion).choices) == 2
    for _, data in _stream(http, "/v1/completions", completion):
        if data != "[DONE]":  # OpenAI streams finish_reason null until a choice ends; openai's model is the whole answer's
            chunk = json.loads(data)
            check({**chunk, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]},
                  Completion)


# -- /v1/responses streamed -------------------------------------------------------------------------------------


def test_responses_stream_as_the_responses_api_events(oa, http):
    body = {"model": MODEL, "input": "Say hello.", "instructions": "You are terse.", "max_output_tokens": 6}
    whole = check(http.post("/v1/responses", json=body).json(), Response)
    events = [(name, EVENT.validate_json(data)) for name, data in _stream(http, "/v1/responses", body)]
    assert all(name == event.type for name, event in events)
    for name, data in _stream(http, "/v1/responses", body):
        check(json.loads(data).get("response") or {"id": "x", "created_at": 0, "model": MODEL, "object": "response",
                                                   "output": [], "parallel_tool_calls": False, "tool_choice": "none",
                                                   "tools": []}, Response)
    kinds = [name for name, _ in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for _, e in events] == list(range(len(events)))
    text = "".join(e.delta for _, e in events if e.type == "response.output_text.delta")
    final = events[-1][1].response
    assert text == final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens

    # the openai client's own streaming helper (it wants the answer complete: response.completed)
    done = oa.responses.create(model=MODEL, input="Say hello.", instructions="You are terse.", max_output_tokens=40)
    assert done.status == "completed"
    with oa.responses.stream(model=MODEL, input="Say hello.", instructions="You are terse.",
                             max_output_tokens=40) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        assert "".join(deltas) == stream.get_final_response().output_text == done.output_text


# -- echo ------------------------------------------------------------------------------------------------


def test_echo_puts_the_prompt_before_each_choice_whole_and_streamed(oa):
    plain = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3)
    echoed = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + plain.choices[0].text
    assert echoed.usage == plain.usage
    streamed = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, echo=True,
                                     stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    ids = oa.completions.create(model=MODEL, prompt=[504, 3575], max_tokens=1, echo=True)  # token ids: their text
    assert len(ids.choices[0].text) > 1


def test_echo_with_logprobs_scores_the_prompt_as_generation_scored_its_tokens(oa):
    """lm-eval's log-likelihood request: the prompt echoed with each token's log probability (the first
    null), which for a greedy continuation are the log probabilities its generation reported."""
    prompt = "The capital of France is"
    gen = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=2)  # " Paris." (text that
    # tokenizes back to the same tokens: "\n" + "\n" generated would be scored as one "\n\n")
    scored = oa.completions.create(model=MODEL, prompt=prompt + gen.choices[0].text, max_tokens=1, echo=True,
                                   logprobs=2)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(prompt + gen.choices[0].text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    continuation = gen.choices[0].logprobs
    k = len(continuation.tokens)
    at = len(lp.tokens) - 1 - k  # the scored prompt ends with the continuation, then comes one generated token
    assert lp.tokens[at : at + k] == continuation.tokens
    assert lp.token_logprobs[at : at + k] == pytest.approx(continuation.token_logprobs, abs=1e-3)
    assert all(len(top) == 2 and max(top.values()) <= 0 for top in lp.top_logprobs[1:])
    assert "".join(lp.tokens[: len(lp.tokens) - 1]) == prompt + gen.choices[0].text  # then the generated token
    with pytest.raises(openai.BadRequestError) as err:  # scoring is answered whole
        oa.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, stream=True)
    assert err.value.param == "echo"


# -- the request fields, against the openai package's typed params ---------------------------------------------


@pytest.mark.unit
def test_every_field_of_openais_typed_params_is_honoured_ignored_or_refused():
    """A field a newer ``openai`` package adds fails here until the server's table says what it does
    with it (honoured, ignored, refused unless at its no-op value), instead of being silently missing."""
    from kvbaton.backend.server import protocol as p
    from kvbaton.backend.server.openai_fields import COMPLETION_FIELDS, RESPONSES_FIELDS, FieldTable
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    from openai.types.responses import response_create_params

    def known(table: FieldTable, model: type) -> set[str]:
        return set(model.model_fields) | table.ignored | table.declared | set(table.unsupported) | table.foreign

    for params, table, model in (
        (chat_params.CompletionCreateParamsBase, COMPLETION_FIELDS, p.ChatCompletionRequest),
        (completion_create_params.CompletionCreateParamsBase, COMPLETION_FIELDS, p.CompletionRequest),
        (response_create_params.ResponseCreateParamsBase, RESPONSES_FIELDS, p.ResponsesRequest),
    ):
        fields = set(params.__annotations__)
        assert fields - known(table, model) == set(), f"{params.__module__}: fields the server does not classify"


# -- a schema too complex for the grammar engine ------------------------------------------------------------


def _wide(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def test_a_schema_the_grammar_engine_cannot_enforce_is_400_naming_the_limit_before_any_work(oa):
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": _wide(2000)}}
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=MODEL, messages=ASK_JOKE, max_tokens=8, response_format=fmt)
    assert err.value.param == "response_format" and "at most 500" in err.value.message
    tool = {"type": "function", "function": {"name": "wide", "parameters": _wide(600)}}
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=MODEL, messages=ASK_JOKE, max_tokens=8, tools=[tool], tool_choice="required")
    assert err.value.param == "tools"


@pytest.mark.unit
def test_the_grammar_limit_is_the_parsers_and_its_failures_are_400():
    from kvbaton.backend.server.grammar import MAX_OPTIONAL_PROPERTIES, check_format, grammar_failure
    from kvbaton.errors import InvalidRequest
    from kvbaton.types import ResponseFormat

    def fmt(schema: dict) -> ResponseFormat:
        return ResponseFormat(type="json_schema", json_schema={"name": "s", "schema": schema})

    check_format(fmt(_wide(MAX_OPTIONAL_PROPERTIES)))  # 500 optional properties: 1,999 parser items, enforced
    check_format(fmt({**_wide(3000), "required": [f"p{i}" for i in range(2600)]}))  # required ones are not the limit
    with pytest.raises(InvalidRequest, match="at most 500"):
        check_format(fmt({"type": "object", "properties": {"inner": _wide(MAX_OPTIONAL_PROPERTIES + 1)}}))
    bad = grammar_failure(RuntimeError("constrained decoding: token 7 rejected: Parser Error: too many items"))
    assert bad is not None and bad.param == "response_format" and grammar_failure(RuntimeError("other")) is None
