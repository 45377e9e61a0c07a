"""A request's many answers, through the real ``openai`` client against the shared ``kvbaton serve``:
a list of prompts to ``/v1/completions`` is one batch (one choice per prompt and per ``n``,
prompt-major as vLLM's, usage summed); ``n`` streamed choices arrive interleaved, as they are
generated together; tool-call arguments stream as the model writes them; log probabilities give a
token's own bytes, a piece of a character included."""

from __future__ import annotations

import json

import openai
import pytest

MODEL = "smollm2-135m-instruct"
PROMPTS = ["One, two, three,", "The capital of France is", "Once upon a time"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city", "unit"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def oa(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_a_list_of_prompts_is_one_batch_of_choices_in_order(oa):
    alone = [oa.completions.create(model=MODEL, prompt=p, max_tokens=4) for p in PROMPTS]
    batch = oa.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    # prompt-major: choices 2i and 2i+1 answer prompt i (greedy: the same text as the prompt alone)
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each prompt once
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    ids = oa.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2)  # token-id prompts
    assert [c.index for c in ids.choices] == [0, 1]
    streamed: dict[int, str] = {}
    for chunk in oa.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [a.choices[0].text for a in alone]
    with pytest.raises(openai.BadRequestError) as err:  # 9 choices: over the server's --max-n (8)
        oa.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=1, n=3)
    assert err.value.param == "prompt"


def test_n_streamed_choices_arrive_interleaved(oa):
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": 8, "n": 3,
           "temperature": 1.0, "seed": 7, "extra_body": {"ignore_eos": True, "kvbaton": {"keep": True}}}
    whole = oa.chat.completions.create(**ask)
    order, texts, finish = [], {0: "", 1: "", 2: ""}, {}
    for chunk in oa.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            if c.delta.content:
                order.append(c.index)
                texts[c.index] += c.delta.content
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        handles = (chunk.model_extra or {}).get("kvbaton", {}).get("handles")
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]  # seeded: the same answers
    assert finish == {0: "length", 1: "length", 2: "length"}
    # generated together, said as they come: choice 1 speaks before choice 0 has finished
    assert order.index(1) < max(i for i, c in enumerate(order) if c == 0), order
    kept = [*(whole.model_extra["kvbaton"]["handles"]), *handles]
    oa.post("/kv/release", body={"handles": kept}, cast_to=object)


def test_tool_call_arguments_stream_as_they_are_written(oa):
    whole = oa.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, tools=TOOLS,
                                       tool_choice="required")
    [call] = whole.choices[0].message.tool_calls
    deltas = [tc for chunk in oa.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, tools=TOOLS,
                                                         tool_choice="required", stream=True)
              for c in chunk.choices for tc in c.delta.tool_calls or ()]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function",
                                                                                       "get_weather", "")
    assert first.id.startswith("call_") and all(d.index == 0 and d.id is None for d in rest)
    pieces = [d.function.arguments for d in rest]
    assert len(pieces) > 3  # piece by piece, not one delta at the end
    assert "".join(pieces) == call.function.arguments and json.loads(call.function.arguments)["city"]


def test_logprobs_give_each_tokens_own_bytes(oa):
    done = oa.chat.completions.create(model=MODEL, max_tokens=6, logprobs=True, top_logprobs=2,
                                      messages=[{"role": "user", "content": "Reply with only emojis: 🙂🌟🎉"}])
    content = done.choices[0].logprobs.content
    answer = done.choices[0].message.content
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace").startswith(answer)
    fragments = [t for t in content if t.token.startswith("bytes:")]
    assert fragments, [t.token for t in content]  # the model writes emojis in byte-level pieces
    for t in fragments:
        assert 0xEF not in t.bytes or t.bytes[:3] != [0xEF, 0xBF, 0xBD]  # never U+FFFD's bytes
        assert t.token == "bytes:" + "".join(f"\\x{b:02x}" for b in t.bytes)
    assert all("\ufffd" not in t.token for t in content)
