"""Chat generation reuses a handle's KV for the longest common token prefix, exactly."""

from __future__ import annotations

from conftest import dense_greedy
from kvbaton import SamplingParams

SYSTEM = {"role": "system", "content": "You are a careful analyst. Answer in one short sentence."}


def test_generate_reuses_a_handle_of_the_templated_prefix(engine, reference):
    question = {"role": "user", "content": "What is a KV cache?"}
    shared = engine.materialize(engine.chat_tokens([SYSTEM])[:-3])  # drop the generation prompt
    result = engine.generate([SYSTEM, question], handle=shared, sampling=SamplingParams(max_tokens=12, ignore_eos=True))

    prompt = engine.chat_tokens([SYSTEM, question])
    assert result.timings.tokens_reused == shared.num_tokens
    assert result.timings.tokens_prefilled == len(prompt) - shared.num_tokens
    assert result.token_ids == dense_greedy(reference, prompt, 12)[0]


def test_next_turn_reuses_the_previous_answer(engine, reference):
    first_q = {"role": "user", "content": "Name a color."}
    first = engine.generate([SYSTEM, first_q], sampling=SamplingParams(max_tokens=10))
    conversation = [SYSTEM, first_q, {"role": "assistant", "content": first.text},
                    {"role": "user", "content": "Name another one."}]
    second = engine.generate(conversation, handle=first.handle, sampling=SamplingParams(max_tokens=10))

    prompt = engine.chat_tokens(conversation)
    assert second.timings.tokens_reused >= len(engine.chat_tokens([SYSTEM, first_q]))
    assert second.timings.tokens_reused + second.timings.tokens_prefilled == len(prompt)
    expected = dense_greedy(reference, prompt, len(second.token_ids))[0]
    assert second.token_ids == expected


def test_handle_longer_than_prompt_reuses_all_but_the_last_token(engine, reference):
    messages = [SYSTEM, {"role": "user", "content": "Say hi."}]
    prompt = engine.chat_tokens(messages)
    longer = engine.materialize(prompt + engine.tokenize("Hello there, friend"))
    result = engine.generate(messages, handle=longer, sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    assert result.timings.tokens_reused == len(prompt) - 1
    assert result.token_ids == dense_greedy(reference, prompt, 8)[0]


def test_unrelated_handle_reuses_nothing(engine):
    other = engine.materialize("Completely different text that shares no prefix")
    result = engine.generate([{"role": "user", "content": "Hi"}], handle=other, sampling=SamplingParams(max_tokens=3))
    assert result.timings.tokens_reused == 0


def test_eos_and_stop_strings_end_generation(engine):
    result = engine.generate([{"role": "user", "content": "Say OK."}], sampling=SamplingParams(max_tokens=60))
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in engine.loaded.eos_token_ids

    counted = engine.resume(engine.materialize("Count: 1, 2, 3, 4,"), sampling=SamplingParams(max_tokens=30, stop=[" 7"]))
    assert counted.finish_reason == "stop"
    assert " 7" not in counted.text
    assert counted.text.strip().startswith("5")


def test_tools_reach_the_chat_template(engine):
    tool = {"type": "function", "function": {"name": "lookup", "description": "Find a fact",
                                             "parameters": {"type": "object", "properties": {}}}}
    plain = engine.chat_tokens([{"role": "user", "content": "hi"}])
    with_tools = engine.chat_tokens([{"role": "user", "content": "hi"}], tools=[tool])
    assert len(with_tools) >= len(plain)
